"""A ``--custom-rm-path`` reward for the drivers' fault tests: its first ``FAULT_RM_HANG``
calls never return (a blocking call inside an ``async def``, as a stuck remote reward
model), every later one returns NaN. Calls are counted in the file ``FAULT_RM_LOG`` (one
line appended per call), across the reward worker processes."""

from __future__ import annotations

import os
import time
from typing import Any


async def hang_then_nan(args: Any, sample: Any) -> float:
    log = os.environ["FAULT_RM_LOG"]
    with open(log, "a") as f:
        f.write("call\n")
    with open(log) as f:
        calls = sum(1 for _ in f)
    if calls <= int(os.environ["FAULT_RM_HANG"]):
        time.sleep(3600)
    return float("nan")
