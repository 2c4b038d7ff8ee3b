"""megatron-core ``GPTDataset`` for pretraining, and the per-rank microbatch iterator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from titan_core.config.pretrain import PretrainConfig
from titan_core.data.arithmetic import generate_problems
from titan_core.data.indexed import indexed_dataset_exists, write_indexed_dataset


def _data_cache_dir(cfg: PretrainConfig) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.run.dir) / "data")


def arithmetic_corpus_prefix(cfg: PretrainConfig, tokenizer) -> Path:  # noqa: ANN001
    """Write (once) the arithmetic corpus as an indexed dataset; return its prefix."""
    d = cfg.data
    prefix = (
        _data_cache_dir(cfg)
        / f"arith_{d.arithmetic_format}_d{d.num_digits}_n{d.num_samples}_s{cfg.train.seed}"
    )
    if not indexed_dataset_exists(prefix):
        docs = (
            tokenizer.tokenize(p.text + "\n")
            for p in generate_problems(
                d.num_samples, d.num_digits, seed=cfg.train.seed, fmt=d.arithmetic_format
            )
        )
        write_indexed_dataset(docs, prefix, tokenizer)
    return prefix


def _blend(cfg: PretrainConfig, tokenizer) -> tuple[list[str], list[float] | None]:  # noqa: ANN001
    """Megatron's blend; the files were checked at start-up (titan_core.data.checks)."""
    if cfg.data.type == "arithmetic":
        return [str(arithmetic_corpus_prefix(cfg, tokenizer))], None
    return cfg.data.blend()


def build_gpt_datasets(cfg: PretrainConfig, tokenizer, train_samples: int, valid_samples: int):  # noqa: ANN001, ANN201
    """Build (train, valid) datasets with megatron-core's builder; rank 0 first, then the rest."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if cfg.data.type == "arithmetic_sft":
        from titan_core.data.sft import arithmetic_sft_dataset

        d = cfg.data

        def rows(num: int, split: str):  # noqa: ANN202
            return arithmetic_sft_dataset(
                num,
                d.num_digits,
                cfg.train.seed,
                d.arithmetic_format,
                cfg.model.seq_length,
                tokenizer,
                split=split,
                tool_fraction=d.tool_fraction,
            )

        return rows(d.num_samples, "train"), (
            rows(valid_samples, "eval") if valid_samples else None
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    cache = _data_cache_dir(cfg) / "index_cache"

    def build():  # noqa: ANN202
        blend = None if cfg.data.type == "synthetic" else _blend(cfg, tokenizer)
        config = GPTDatasetConfig(
            random_seed=cfg.train.seed,
            sequence_length=cfg.model.seq_length,
            blend=blend,
            split=cfg.data.split,
            tokenizer=tokenizer,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            path_to_cache=str(cache),
            mid_level_dataset_surplus=0.005,
        )
        cls = MockGPTDataset if cfg.data.type == "synthetic" else GPTDataset
        sizes = [train_samples, valid_samples, 0]
        # Build no split the run does not read: megatron-core builds one of size 0 anyway,
        # and loops forever when it has no tokens (see titan_core.data.checks).
        config.split_matrix = [
            m if n else None for m, n in zip(config.split_matrix, sizes, strict=True)
        ]
        return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()

    if rank == 0:
        datasets = build()
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        datasets = build()
    return datasets[0], datasets[1]


def microbatches(
    dataset,  # noqa: ANN001
    micro_batch_size: int,
    num_microbatches: int,
    dp_rank: int,
    dp_size: int,
    start_sample: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless microbatches for this data-parallel rank, in Megatron's sample order.

    A global batch is ``num_microbatches x micro_batch_size x dp_size`` consecutive samples;
    within each group of ``micro_batch_size x dp_size`` samples, rank r takes the r-th slice.
    ``start_sample`` (= consumed samples) makes resume continue with the same data.
    """
    n = len(dataset)
    sample = start_sample
    while True:
        lo = sample + dp_rank * micro_batch_size
        items = [dataset[(lo + i) % n] for i in range(micro_batch_size)]
        sample += micro_batch_size * dp_size
        yield {
            key: torch.stack([torch.as_tensor(item[key]) for item in items])
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }
