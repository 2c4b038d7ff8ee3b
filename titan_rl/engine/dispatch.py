"""Hand a request's sequences to the engine and wait for them, or stream their tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from titan_rl.engine.core import Engine, Sequence, sequence_result


async def run_sequences(engine: Engine, seqs: list[Sequence]) -> list[Sequence]:
    """Submit sequences and wait for all of them; abort them if the caller goes away."""
    loop = asyncio.get_running_loop()
    futures = []
    for s in seqs:
        fut = loop.create_future()

        def done(seq: Sequence, fut: asyncio.Future = fut) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(seq))

        s.on_done = done
        futures.append(fut)
    engine.submit(seqs)
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:
        for s in seqs:
            engine.call(lambda s=s: engine.abort(s.rid))
        raise


def stream_sequences(engine: Engine, seqs: list[Sequence], single: bool) -> AsyncIterator[bytes]:
    """Submit now (so a bad rid is a 400, not a broken stream) and return the SSE chunks:
    ``data: {cumulative response}`` per token, the final response, then ``data: [DONE]``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, dict[str, Any], bool]] = asyncio.Queue()
    for i, s in enumerate(seqs):

        def on_token(seq: Sequence, i: int = i) -> None:
            chunk = engine.snapshot(seq)
            loop.call_soon_threadsafe(queue.put_nowait, (i, chunk, False))

        def on_done(seq: Sequence, i: int = i) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (i, sequence_result(seq), True))

        s.on_token, s.on_done = on_token, on_done
    engine.submit(seqs)

    async def chunks() -> AsyncIterator[bytes]:
        remaining = len(seqs)
        try:
            while remaining:
                i, chunk, final = await queue.get()
                if not single:
                    chunk["index"] = i
                if final:
                    remaining -= 1
                    if seqs[i].error:
                        chunk = {"error": {"message": seqs[i].error, "code": 500}}
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if remaining:  # the caller went away: stop generating for it
                for s in seqs:
                    engine.call(lambda s=s: engine.abort(s.rid))

    return chunks()
