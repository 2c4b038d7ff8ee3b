"""Pack ``Sample``s into the padded tensors the trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_rl.sample import Sample, Status


@dataclass
class RLBatch:
    """Row i = prompt + response of sample i, right-padded. Per-token fields are aligned with
    ``labels = tokens[:, 1:]``: position t scores token t+1."""

    tokens: torch.Tensor  # [B, L] int64
    #: [B, L-1] float: 1 on trained response tokens (0 on the prompt, padding, FAILED
    #: samples and response tokens whose ``Sample.loss_mask`` is 0); every loss term, the
    #: advantages and the rollout correction count only these
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor  # [B, L-1] float (0 off the response)
    rewards: torch.Tensor  # [B]
    #: per-sequence advantages [B], computed by the caller (slime/miles hand rewards already
    #: normalized per group); None: the trainer computes them from ``rewards``.
    advantages: torch.Tensor | None = None
    #: [B, L-1] logprobs of the policy before this rollout's updates; None: the trainer
    #: computes them (a caller splitting one rollout into several optimizer steps passes
    #: those it computed once, before the first step).
    old_logprobs: torch.Tensor | None = None
    #: [B, L, num_layers, top_k] int64: row t holds the experts the rollout engine routed
    #: token t to (the forward at position t, as the trainer's routers see it); -1 where the
    #: engine reported none (the last token of each sample, padding). None: not requested.
    routed_experts: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, lo: int, hi: int) -> RLBatch:
        return self.select(slice(lo, hi))

    def select(self, index: slice | torch.Tensor) -> RLBatch:
        """The rows ``index`` picks (a slice or a tensor of row indices)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return RLBatch(
            self.tokens[index],
            self.response_mask[index],
            self.rollout_logprobs[index],
            self.rewards[index],
            pick(self.advantages),
            pick(self.old_logprobs),
            pick(self.routed_experts),
        )


def pack_samples(samples: list[Sample], pad_id: int, pad_to_multiple: int = 8) -> RLBatch:
    """The samples as one right-padded batch: tokens ``[B, L]`` (L a multiple of
    ``pad_to_multiple``), and the loss mask and rollout logprobs ``[B, L - 1]`` on the positions
    that predict each response token. Rows are built as Python lists and made tensors once
    (a few small tensor writes per sample cost ~5 ms a 64-sample batch)."""
    length = max(len(s.tokens) for s in samples)
    length = -(-length // pad_to_multiple) * pad_to_multiple
    width = length - 1
    token_rows: list[list[int]] = []
    mask_rows: list[list[float]] = []
    rollout_rows: list[list[float]] = []
    for s in samples:
        seq = s.tokens
        token_rows.append(seq + [pad_id] * (length - len(seq)))
        p, r = len(s.prompt_tokens), s.response_length
        if r and s.status != Status.FAILED:  # FAILED (e.g. an invalid reward): no loss
            lead, tail = [0.0] * (p - 1), [0.0] * (width - (p - 1) - r)
            mask_rows.append(lead + loss_mask_values(s) + tail)
            logps = s.rollout_log_probs if len(s.rollout_log_probs) == r else [0.0] * r
            rollout_rows.append(lead + [float(v) for v in logps] + tail)
        else:
            mask_rows.append([0.0] * width)
            rollout_rows.append([0.0] * width)
    return RLBatch(
        torch.tensor(token_rows, dtype=torch.long),
        torch.tensor(mask_rows, dtype=torch.float32),
        torch.tensor(rollout_rows, dtype=torch.float32),
        torch.tensor([s.reward for s in samples], dtype=torch.float32),
        routed_experts=pack_routed(samples, length),
    )


def loss_mask_values(s: Sample) -> list[float]:
    """``s``'s response tokens that carry loss (1) and those only fed (0: a tool's or an
    environment's reply); every token when ``s.loss_mask`` is None."""
    if s.loss_mask is None:
        return [1.0] * s.response_length
    if len(s.loss_mask) != s.response_length or any(m not in (0, 1) for m in s.loss_mask):
        raise ValueError(
            f"sample {s.group_index}/{s.index}: loss_mask must hold one 0 or 1 per response "
            f"token ({s.response_length}), got {len(s.loss_mask)} values; a rollout hook "
            "appending tokens appends their mask too"
        )
    return [float(m) for m in s.loss_mask]


def pack_routed(samples: list[Sample], length: int) -> torch.Tensor | None:
    """The samples' ``rollout_routed_experts`` as ``[B, length, layers, top_k]`` (-1 where the
    engine routed nothing); None when no sample carries them."""
    have = [s.rollout_routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(
            f"{have.count(False)} of {len(samples)} samples carry no rollout_routed_experts: "
            "a batch needs them on every sample (rollout.return_routed_experts on every engine)"
        )
    first = torch.as_tensor(samples[0].rollout_routed_experts)
    out = torch.full((len(samples), length, *first.shape[1:]), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        routed = torch.as_tensor(s.rollout_routed_experts)
        if routed.shape != (len(s.tokens) - 1, *first.shape[1:]):
            raise ValueError(
                f"sample {s.index}: rollout_routed_experts has shape {tuple(routed.shape)}, "
                f"expected ({len(s.tokens) - 1}, {', '.join(map(str, first.shape[1:]))}) "
                "(one row per token but the last); ask the engine with "
                "routed_experts_start_len=0"
            )
        out[i, : routed.shape[0]] = routed
    return out
