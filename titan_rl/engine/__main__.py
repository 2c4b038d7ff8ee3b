"""``python -m titan_rl.engine --model-path P --host 127.0.0.1 --port N``: the CPU engine."""

from titan_rl.engine.cli import main

if __name__ == "__main__":
    main()
