"""Titan's prompts (the Titan YAML's ``data`` section) as a slime / miles data source.

slime's and miles' own sources read ``--prompt-data`` with the HF tokenizer of
``--hf-checkpoint`` (miles' also import ``sglang``); a Titan run may have neither (the
arithmetic task is generated, its tokenizer is Titan's byte tokenizer). :class:`TitanPrompts`
reads the ``data`` section (``arithmetic``, ``jsonl`` or ``parquet``: the loader
``titan_rl.grpo`` uses) and hands groups of ``--n-samples-per-prompt`` samples drawn by
Titan's seeded sampler; its position is saved with each checkpoint in ``--save`` (``save`` /
``load``), as the frameworks' sources do. ``eval_samples()`` gives the held-out prompts.
``adapters.slime.data_source`` and ``adapters.miles.data_source`` bind it to their
framework's ``Sample``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from adapters.common.config import titan_config_from_args


class TitanPrompts:
    """Prompts of the Titan YAML as groups of the framework's ``Sample`` (``sample_type``)."""

    sample_type: Any = None

    def __init__(self, args: Any) -> None:
        from titan_rl.data import PromptSampler, load_prompts

        self.args = args
        cfg = titan_config_from_args(args)
        seed = args.rollout_seed
        self._train = load_prompts(cfg.data, seed, "train")
        self._eval = load_prompts(cfg.data, seed, "eval")
        # --prompt-data: slime's Dataset order (shuffled per epoch only with --rollout-shuffle)
        shuffle = bool(args.rollout_shuffle) if getattr(args, "prompt_data", None) else True
        self.sampler = PromptSampler(self._train.prompts, seed, shuffle=shuffle)
        self.group_index = 0
        self.sample_index = 0

    def _sample(self, prompt: Any) -> Any:
        return self.sample_type(
            prompt=prompt.text, label=prompt.label, metadata=dict(prompt.metadata)
        )

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """``num_samples`` prompts, each a group of ``n_samples_per_prompt`` samples sharing
        ``group_index`` (slime and miles normalize rewards per group by it)."""
        groups = []
        for prompt in self.sampler.take(num_samples):
            base = self._sample(prompt)
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                s = copy.deepcopy(base)
                s.group_index, s.index = self.group_index, self.sample_index
                self.sample_index += 1
                group.append(s)
            self.group_index += 1
            groups.append(group)
        return groups

    def eval_samples(self) -> list[Any]:
        """One sample per held-out prompt (``data.num_eval`` of them, or ``data.eval_path``)."""
        return [self._sample(p) for p in self._eval.prompts]

    def add_samples(self, samples: list[list[Any]]) -> None:
        raise NotImplementedError("Titan's prompt source keeps no buffer of returned samples")

    def _state_path(self, rollout_id: int) -> Path | None:
        save = getattr(self.args, "save", None)
        return Path(save) / f"rollout/titan_prompt_source_{rollout_id}.json" if save else None

    def save(self, rollout_id: int) -> None:
        path = self._state_path(rollout_id)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "sampler": self.sampler.state(),
            "group_index": self.group_index,
            "sample_index": self.sample_index,
        }
        path.write_text(json.dumps(state))

    def load(self, rollout_id: int | None = None) -> None:
        """The position after rollout ``rollout_id`` (nothing to load: a fresh start)."""
        if rollout_id is None or rollout_id < 0:
            return
        path = self._state_path(rollout_id)
        if path is None or not path.is_file():
            return
        state = json.loads(path.read_text())
        self.sampler.restore(state["sampler"])
        self.group_index, self.sample_index = state["group_index"], state["sample_index"]

    def __len__(self) -> int:
        return len(self._train.prompts)
