"""``Sample``: the one contract between rollout and training (slime's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Status(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One prompt's response: tokens, logprobs the engine reported, reward, bookkeeping."""

    group_index: int
    index: int
    prompt: str
    prompt_tokens: list[int]
    label: str
    response: str = ""
    response_tokens: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    #: one per response token: 1 trained, 0 fed to the model but not trained (an
    #: environment's or a tool's reply in a multi-turn rollout); None: every token is trained
    loss_mask: list[int] | None = None
    reward: float = 0.0
    #: the reward judged the answer right (None: not judged)
    correct: bool | None = None
    status: Status = Status.PENDING
    #: the weight version the engine generated it with (SGLang's meta_info.weight_version);
    #: the rollout refuses or counts one the policy does not expect (rollout.on_stale_version)
    weight_version: str = ""
    #: the weight version that produced each response token ("" for a token the model did
    #: not write, e.g. a tool's reply); a partial rollout continued across a weight update
    #: holds several. Empty: every token is ``weight_version``'s
    weight_versions: list[str] = field(default_factory=list)
    #: the prompt's metadata; a multi-turn rollout adds ``turns``, ``tool_calls`` and
    #: ``stop_reason`` (titan_rl.rollout.multiturn)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: the experts the engine routed each token to, int32 ``[len(tokens) - 1, num_layers,
    #: top_k]`` (the last token is never fed); None unless ``rollout.return_routed_experts``
    rollout_routed_experts: torch.Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_tokens + self.response_tokens

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    def token_versions(self) -> list[str]:
        """The weight version of each response token (see ``weight_versions``)."""
        if len(self.weight_versions) == self.response_length:
            return list(self.weight_versions)
        return [self.weight_version] * self.response_length
