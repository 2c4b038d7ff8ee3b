"""``parallel.num_layers_in_first/last_pipeline_stage`` (megatron-core's uneven pipeline
split): the config accepts exactly the splits megatron-core builds, and refuses the others
by name at load."""

from __future__ import annotations

import itertools

import pytest

from tests.core.pretrain_runner import TINY
from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig


def _megatron_builds(layers: int, pp: int, vpp: int | None, first, last) -> bool:  # noqa: ANN001
    """Whether megatron-core's own config and layer count make a model of ``layers`` layers
    with at least one on every stage's every chunk."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    try:
        tf = TransformerConfig(
            num_layers=layers, hidden_size=64, num_attention_heads=4,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            pipeline_dtype=torch.float32,
        )  # fmt: skip
        counts = [
            get_num_layers_to_build(tf, vp_stage=v, pp_rank=rank)
            for rank in range(pp)
            for v in (range(vpp) if vpp else [None])
        ]
    except (ValueError, AssertionError):
        return False
    return min(counts) >= 1 and sum(counts) == layers


def test_the_accepted_splits_are_megatrons() -> None:
    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron()
    grid = itertools.product(range(1, 9), (2, 3, 4), (None, 2), (None, 1, 2, 3, 4), (None, 1, 2, 3))
    checked = 0
    for layers, pp, vpp, first, last in grid:
        overrides = [
            f"model.num_layers={layers}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"parallel.virtual_pipeline_model_parallel_size={vpp or 'null'}",
            f"parallel.num_layers_in_first_pipeline_stage={first or 'null'}",
            f"parallel.num_layers_in_last_pipeline_stage={last or 'null'}",
        ]
        try:
            load_config(PretrainConfig, TINY, overrides)
            ours = True
        except ConfigError:
            ours = False
        assert ours == _megatron_builds(layers, pp, vpp, first, last), overrides
        checked += ours
    assert checked > 50  # the grid holds uneven splits that build, not only refusals


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["parallel.num_layers_in_first_pipeline_stage=1"],
         "parallel.num_layers_in_first_pipeline_stage needs parallel.pipeline_model_parallel_size >= 2"),
        (["parallel.pipeline_model_parallel_size=2", "parallel.num_layers_in_first_pipeline_stage=1",
          "parallel.num_layers_in_last_pipeline_stage=2"],
         "(1 + 2) must add up to model.num_layers (4)"),
        (["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
          "parallel.num_layers_in_last_pipeline_stage=1"],
         "parallel.num_layers_in_last_pipeline_stage (1) must be divisible by "
         "parallel.virtual_pipeline_model_parallel_size (2)"),
        (["parallel.pipeline_model_parallel_size=3", "parallel.num_layers_in_first_pipeline_stage=1"],
         "the 3 layers parallel.num_layers_in_first_pipeline_stage leave"),
        (["model.num_layers=5", "parallel.pipeline_model_parallel_size=2"],
         "or set parallel.num_layers_in_first_pipeline_stage"),
    ],
)  # fmt: skip
def test_a_split_megatron_cannot_build_is_refused_by_name(overrides, needle) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, TINY, overrides)
    assert needle in str(e.value)
