"""Titan's pretraining loop against a bare megatron-core loop: same model, batch, processes.

    python bench/pretrain_overhead.py [--steps 30] [--nproc 1]

Both run in fresh processes, one after the other, on the same machine. The bare loop is
the minimum megatron-core needs (process groups, GPTModel, DDP, optimizer, the schedule,
in-memory batches); on CPU it uses Titan's compat layer too, since megatron-core cannot run
there without one. Prints the median tokens/s of each (first steps dropped as warm-up) and
the ratio. Goal: at least 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "pretrain_tiny.yaml"
WARMUP = 3


def bare_loop(steps: int, out: str) -> None:
    """A bare megatron-core training loop on the config's model and batch."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from titan_core.accelerator import get_accelerator
    from titan_core.config import load_config
    from titan_core.config.pretrain import PretrainConfig

    cfg = load_config(PretrainConfig, CONFIG)
    m, t = cfg.model, cfg.train
    accel = get_accelerator()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(
        accel.communication_backend(),
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(t.seed)
    dp = dist.get_world_size()
    tf = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )
    vocab = 384
    model = GPTModel(
        tf,
        get_gpt_layer_local_spec(normalization=m.normalization),
        vocab,
        m.seq_length,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )
    model = DistributedDataParallel(tf, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=t.lr, clip_grad=t.clip_grad, weight_decay=0.01),
        [model],
    )
    tf.no_sync_func = model.no_sync
    tf.finalize_model_grads_func = finalize_model_grads
    tf.grad_scale_func = opt.scale_loss
    mbs, seq = t.micro_batch_size, m.seq_length
    nmb = t.global_batch_size // (mbs * dp)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 258, (mbs, seq + 1), generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, -1)

    def data():
        while True:
            yield batch

    def forward_step(it, model):
        x, y = next(it)
        out = model(x, pos, None, labels=y)

        def loss_fn(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_fn

    rates = []
    it = data()
    for _ in range(steps):
        start = time.perf_counter()
        model.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=it,
            model=model,
            num_microbatches=nmb,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        opt.step()
        rates.append(t.global_batch_size * seq / (time.perf_counter() - start))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rates))
    dist.destroy_process_group()


def _launch(module_args: list[str], nproc: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    prefix = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", str(nproc)]
    )  # fmt: skip
    subprocess.run(
        [*prefix, *module_args], check=True, env=env, stdout=subprocess.DEVNULL, cwd=REPO
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--bare-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_out:
        from titan_core.accelerator import get_accelerator, megatron_scope
        from titan_core.accelerator.megatron_compat import install_megatron_compat

        install_megatron_compat(get_accelerator())
        with megatron_scope():  # all the bare loop does is call megatron-core
            bare_loop(args.steps, args.bare_out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        bare_out = Path(tmp) / "bare.json"
        _launch([str(Path(__file__).resolve()), "--steps", str(args.steps),
                 "--bare-out", str(bare_out)], args.nproc)  # fmt: skip
        bare = json.loads(bare_out.read_text())[WARMUP:]
        run_dir = Path(tmp) / "titan"
        _launch(
            ["-m", "titan_core.pretrain", "--config", str(CONFIG), f"run.dir={run_dir}",
             f"train.train_iters={args.steps}", "train.lr_warmup_iters=1",
             "checkpoint.save_interval=0", "data.num_samples=20000"],
            args.nproc,
        )  # fmt: skip
        records = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        titan = [r["tokens_per_s"] for r in records][WARMUP:-1]  # last step also saves
    b, ti = statistics.median(bare), statistics.median(titan)
    print(f"bare megatron-core: {b:,.0f} tokens/s (median of {len(bare)} steps)")
    print(f"titan_core.pretrain: {ti:,.0f} tokens/s (median of {len(titan)} steps)")
    print(f"ratio titan / bare: {ti / b:.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
