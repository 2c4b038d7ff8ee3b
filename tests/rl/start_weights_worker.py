"""The trainer's own start-up export (``PolicyTrainer.save_hf``, what the GRPO job writes to
``<run.dir>/hf_start`` when its engines wait for it), in its own process (one rank, gloo).

``python tests/rl/start_weights_worker.py --out DIR -- <GRPO overrides>``
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()

    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig
    from titan_rl.trainer.policy import PolicyTrainer

    trainer = PolicyTrainer(load_config(GRPOConfig, None, a.overrides))
    trainer.save_hf(a.out)
    trainer.shutdown()


if __name__ == "__main__":
    main()
