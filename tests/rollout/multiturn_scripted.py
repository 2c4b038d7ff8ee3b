"""A scripted engine client for rollout-hook tests: each ``generate`` call answers the next
scripted turn (ids and finish reason), capped at the request's ``max_new_tokens``, and
records what was sent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titan_core.data.tokenizer import ByteTokenizer
from titan_rl.rollout.engine_api import GenerateOutput

TOK = ByteTokenizer()
EOS = TOK.eod


def encode(text: str) -> list[int]:
    return TOK.encode(text)


def decode(ids: list[int]) -> str:
    return TOK.decode([i for i in ids if i != EOS])


def stop_at(text: str) -> dict[str, Any]:
    return {"type": "stop", "matched": text}


EOS_STOP = {"type": "stop", "matched": EOS}


@dataclass
class Turn:
    ids: list[int]
    finish: dict[str, Any]


@dataclass
class ScriptedEngine:
    """Answers the scripted ``turns`` in order, or ``respond(input_ids)`` when given."""

    turns: list[Turn] = field(default_factory=list)
    respond: Callable[[list[int]], Turn] | None = None
    version: str = "3"
    requests: list[dict[str, Any]] = field(default_factory=list)
    base_url: str = "scripted://engine"

    @staticmethod
    def logprobs(ids: list[int]) -> list[float]:
        """The logprob the script reports for each token: -(id / 1000)."""
        return [-t / 1000 for t in ids]

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = False,
        **extra: Any,
    ) -> GenerateOutput | list[GenerateOutput]:
        sp = dict(sampling_params or {})
        self.requests.append(
            {"input_ids": list(input_ids), "params": sp, "logprob": return_logprob, "extra": extra}
        )
        turn = self.respond(list(input_ids)) if self.respond else self.turns.pop(0)
        limit = int(sp.get("max_new_tokens", len(turn.ids)))
        ids = turn.ids[:limit]
        finish = turn.finish if len(ids) == len(turn.ids) else {"type": "length", "length": limit}
        outs = [
            GenerateOutput(
                output_ids=list(ids),
                finish_reason=finish,
                weight_version=self.version,
                prompt_tokens=len(input_ids),
                completion_tokens=len(ids),
                rid=None,
                output_logprobs=self.logprobs(ids) if return_logprob else None,
            )
            for _ in range(int(sp.get("n", 1)))
        ]
        return outs if sp.get("n", 1) > 1 else outs[0]

    async def abort_request(self, rid: str = "", abort_all: bool = False, **kw: Any) -> None:
        return None
