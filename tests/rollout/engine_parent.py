"""A stand-in for the Ray actor that holds an engine (tests/rollout/test_engine_orphans.py).

``python tests/rollout/engine_parent.py MODEL LOG_DIR TP_SIZE RESTART`` starts a built-in
engine as ``RolloutEngine`` does in its actor, from a thread that then ends (Ray runs actor
methods on threads of its own), and has its supervisor watch it; with RESTART=1 it kills the
server once, so that the one left running was started by the watch thread. It prints the
pid of the server running then, as JSON, and sleeps until it is killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from titan_rl.actors.config import EngineServerConfig
from titan_rl.actors.engine_process import RolloutEngine


def main() -> None:
    model, log_dir, tp_size, restart = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    cfg = EngineServerConfig(
        model_path=model, backend="builtin", num_threads=1, tp_size=tp_size, log_dir=log_dir,
        startup_timeout_s=120,
    )  # fmt: skip
    engine = RolloutEngine(cfg.launch("cpu"))
    starter = threading.Thread(target=engine.start)
    starter.start()
    starter.join()
    if restart == "1":
        first = engine.pid()
        assert first is not None
        os.killpg(first, signal.SIGKILL)
        while engine.restarts() < 1 or not engine.alive() or engine.pid() == first:
            time.sleep(0.1)
        engine.wait_healthy(120)
    print(json.dumps({"server": engine.pid()}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
