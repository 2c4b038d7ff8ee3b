"""``exit_process``: the commands' way out keeps their exit code, runs the atexit handlers
(logging's flush, multiprocessing's joins) and flushes what was written."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import atexit, logging, sys
from titan_core.process_exit import exit_process
logging.basicConfig(stream=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
print("written", end="")  # left in the buffer: the exit flushes it
logging.getLogger("t").warning("logged")
exit_process(int(sys.argv[1]) if sys.argv[1] != "none" else None)
"""


def test_exit_code_handlers_and_buffers_are_as_with_system_exit():
    for code, want in (("0", 0), ("2", 2), ("143", 143), ("none", 0)):
        proc = subprocess.run([sys.executable, "-c", CODE, code], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == want
        assert proc.stdout == "writtenatexit ran\n"
        assert "logged" in proc.stderr
