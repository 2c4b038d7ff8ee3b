"""Build a config's model chunks on one CPU process and print, as JSON, which modules run
the emulated FP8 GEMM: ``python -m tests.fp8.build_worker key=value ...``."""

from __future__ import annotations

import json
import sys


def main(overrides: list[str]) -> None:
    from titan_core.config.loader import apply_overrides
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.models.gpt import build_model_chunks, build_transformer_config
    from titan_core.parallel.initialize import initialize

    cfg = PretrainConfig.model_validate(apply_overrides({}, overrides))
    accel, _, _ = initialize(cfg)
    tf = build_transformer_config(cfg, accel)
    (chunk,) = build_model_chunks(cfg, tf, 256, accel)
    switched = sorted(n for n, m in chunk.named_modules() if hasattr(m, "fp8_emulation"))
    linears = sorted(n for n, m in chunk.named_modules() if hasattr(m, "_forward_impl"))
    print(json.dumps({"tf_fp8": tf.fp8, "switched": switched, "linears": linears}))


if __name__ == "__main__":
    main(sys.argv[1:])
