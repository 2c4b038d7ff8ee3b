"""Custom rewards that misbehave on cue (the response says how), for the fault tests."""

from __future__ import annotations

import asyncio
import os
import time


def by_response(prompt: str, response: str, label: str, metadata: dict) -> object:
    """ "hang": blocks for an hour; "die": the process exits; "raise": KeyError; "value":
    returns ``metadata["value"]`` as is; anything else: 1.0."""
    if response == "hang":
        time.sleep(3600)
    if response == "die":
        os._exit(7)
    if response == "raise":
        raise KeyError("boom")
    if response == "value":
        return metadata["value"]
    return 1.0


async def async_by_response(prompt: str, response: str, label: str, metadata: dict) -> object:
    """ "block": blocks its event loop (a sync call inside async); "wait": awaits for an hour;
    "value": ``metadata["value"]``; anything else: 0.5."""
    if response == "block":
        time.sleep(3600)
    if response == "wait":
        await asyncio.sleep(3600)
    if response == "value":
        return metadata["value"]
    await asyncio.sleep(0)
    return 0.5
