"""Each parallel layout reproduces the single-process losses (fp32, same weights, same data).

All runs start from one seed checkpoint (``checkpoint.pretrained_checkpoint``), which
dist_checkpointing reshards into every layout, so any difference is the layout's own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.core.pretrain_runner import FAST, TINY, TINY_MOE, losses, run_pretrain

pytestmark = pytest.mark.slow
STEPS = ["train.train_iters=3"]
#: the layouts run on 2 processes from the seed checkpoint
LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "pp2-1f1b": ["parallel.pipeline_model_parallel_size=2"],
    "pp2-vpp2": [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ],
    # megatron-core's uneven split: 1 of the 4 layers on the first stage, 3 on the last
    "pp2-uneven": [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.num_layers_in_first_pipeline_stage=1",
    ],
}


@pytest.fixture(scope="module")
def dense_seed(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("dense_seed")
    run_pretrain(TINY, [*FAST, "train.train_iters=2", f"run.dir={d}"])
    return str(d / "checkpoints")


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory, dense_seed) -> list[float]:
    d = tmp_path_factory.mktemp("dense_ref")
    run_pretrain(
        TINY, [*FAST, *STEPS, f"run.dir={d}", f"checkpoint.pretrained_checkpoint={dense_seed}"]
    )
    return losses(d)


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory, dense_seed) -> Callable[[str], Path]:
    """``layout_run(name)``: the run folder of the seed's 3 steps at ``LAYOUTS[name]`` on 2
    processes, run once for every test that reads it (the same command: the layout's loss
    parity, the TP=2 vocabulary rows, the plain side of the VPP activation offload)."""
    done: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in done:
            d = tmp_path_factory.mktemp(name)
            proc = run_pretrain(
                TINY,
                [*FAST, *STEPS, *LAYOUTS[name], f"run.dir={d}",
                 f"checkpoint.pretrained_checkpoint={dense_seed}"],
                nproc=2,
            )  # fmt: skip
            (d / "stdout.log").write_text(proc.stdout)
            done[name] = d
        return done[name]

    return run


#: the decoder layers per pipeline stage each layout builds (megatron-core's count, printed
#: at start-up)
STAGE_LAYERS = {"pp2-1f1b": "2, 2", "pp2-vpp2": "2, 2", "pp2-uneven": "1, 3"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dense_layout_matches_single_process(layout_run, dense_reference, layout):
    run = layout_run(layout)
    if layout in STAGE_LAYERS:
        stdout = (run / "stdout.log").read_text()
        assert f"layers per pipeline stage: {STAGE_LAYERS[layout]}\n" in stdout
    got = losses(run)
    assert len(got) == len(dense_reference) == 3
    assert got == pytest.approx(dense_reference, rel=1e-4)
    assert got[-1] < got[0], "the loss should fall over three steps"


def test_padded_vocabulary_follows_the_checkpoint(dense_seed, layout_run):
    """A TP=1 checkpoint pads the vocabulary to 384 rows, a new TP=2 model to 512: loaded at
    TP=2 it keeps the checkpoint's 384 rows (the same model), and its HF export says so."""
    from titan_core.checkpoint import latest_iteration, saved_vocab_rows

    assert saved_vocab_rows(dense_seed, latest_iteration(dense_seed)) == 384
    saved = layout_run("tp2") / "checkpoints"
    assert saved_vocab_rows(saved, latest_iteration(saved)) == 384


def test_vocabulary_tp_cannot_split_is_refused(tmp_path):
    """A checkpoint whose vocabulary rows TP=2 cannot split (259) is an error naming the
    rows and the key, not a silently different model."""
    seed = tmp_path / "seed"
    run_pretrain(TINY, [*FAST, "train.train_iters=2", "model.vocab_size=259",
                        "model.make_vocab_size_divisible_by=1", f"run.dir={seed}"])  # fmt: skip
    proc = run_pretrain(
        TINY,
        [*FAST, *STEPS, "model.vocab_size=259", "parallel.tensor_model_parallel_size=2",
         f"run.dir={tmp_path / 'tp2'}", f"checkpoint.pretrained_checkpoint={seed / 'checkpoints'}"],
        nproc=2, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "259 rows" in proc.stderr and "tensor_model_parallel_size=2" in proc.stderr


def test_moe_expert_parallel_matches_single_process(tmp_path_factory):
    seed = tmp_path_factory.mktemp("moe_seed")
    run_pretrain(TINY_MOE, [*FAST, "train.train_iters=2", f"run.dir={seed}"])
    ref_dir, ep_dir = tmp_path_factory.mktemp("moe_ref"), tmp_path_factory.mktemp("moe_ep2")
    common = [*FAST, *STEPS, f"checkpoint.pretrained_checkpoint={seed / 'checkpoints'}"]
    run_pretrain(TINY_MOE, [*common, f"run.dir={ref_dir}"])
    run_pretrain(
        TINY_MOE, [*common, f"run.dir={ep_dir}", "parallel.expert_model_parallel_size=2"], nproc=2
    )
    assert losses(ep_dir) == pytest.approx(losses(ref_dir), rel=1e-4)


def test_activation_offload_on_vpp_changes_nothing(tmp_path, dense_seed, layout_run):
    """megatron's fine-grained activation offload (1F1B/VPP aware) against the same run
    without it (the pp2-vpp2 layout's run): identical losses."""
    run_pretrain(
        TINY,
        [*FAST, *STEPS, *LAYOUTS["pp2-vpp2"], f"run.dir={tmp_path / 'offload'}",
         f"checkpoint.pretrained_checkpoint={dense_seed}", "train.offload_modules=[core_attn]"],
        nproc=2,
    )  # fmt: skip
    assert losses(tmp_path / "offload") == pytest.approx(losses(layout_run("pp2-vpp2")), rel=1e-6)


def test_expert_parallel_overlap_matches_plain_schedule(tmp_path):
    """EP comm/compute overlap (megatron's combined 1F1B, bf16) against plain EP=2 in bf16."""
    common = [*FAST, *STEPS, "train.bf16=true", "parallel.expert_model_parallel_size=2"]
    run_pretrain(TINY_MOE, [*common, f"run.dir={tmp_path / 'plain'}"], nproc=2)
    run_pretrain(
        TINY_MOE,
        [
            *common,
            f"run.dir={tmp_path / 'overlap'}",
            "parallel.overlap_moe_expert_parallel_comm=true",
        ],
        nproc=2,
    )
    assert losses(tmp_path / "overlap") == pytest.approx(losses(tmp_path / "plain"), rel=1e-3)


SFT_EVAL = [
    "data.type=arithmetic_sft",
    "train.eval_interval=3",
    "train.eval_iters=2",
]


def _eval_record(run_dir) -> dict:  # noqa: ANN001
    from titan_core.training.metrics import read_metrics

    (record,) = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/loss" in r]
    return record


@pytest.fixture(scope="module")
def sft_eval_reference(tmp_path_factory, dense_seed) -> dict:
    d = tmp_path_factory.mktemp("sft_ref")
    run_pretrain(
        TINY,
        [
            *FAST,
            *STEPS,
            *SFT_EVAL,
            f"run.dir={d}",
            f"checkpoint.pretrained_checkpoint={dense_seed}",
        ],
    )
    return _eval_record(d)


@pytest.mark.parametrize(
    "layout",
    [["parallel.tensor_model_parallel_size=2"], ["parallel.pipeline_model_parallel_size=2"]],
    ids=["tp2", "pp2"],
)
def test_eval_matches_single_process(tmp_path, dense_seed, sft_eval_reference, layout):
    """Eval loss and exact match (logits gathered over TP, reduced from the last stage)."""
    run_pretrain(
        TINY,
        [*FAST, *STEPS, *SFT_EVAL, *layout, f"run.dir={tmp_path}",
         f"checkpoint.pretrained_checkpoint={dense_seed}"],
        nproc=2,
    )  # fmt: skip
    got = _eval_record(tmp_path)
    assert got["step"] == 3
    assert got["eval/loss"] == pytest.approx(sft_eval_reference["eval/loss"], rel=1e-4)
    assert got["eval/accuracy"] == sft_eval_reference["eval/accuracy"]
