"""``TitanPromptSource``: a slime ``DataSource`` (``--data-source-path``) over Titan's prompts.

slime's own ``RolloutDataSourceWithBuffer`` reads ``--prompt-data`` with the HF tokenizer of
``--hf-checkpoint``; a Titan run may have neither (the arithmetic task is generated, its
tokenizer is Titan's byte tokenizer). This source reads the Titan YAML's ``data`` section
(``arithmetic``, ``jsonl`` or ``parquet``, the same loader as ``titan_rl.grpo``) and hands
slime ``Sample`` groups of ``--n-samples-per-prompt``, drawn by Titan's seeded sampler; its
position is saved with each checkpoint (``save`` / ``load``), as slime's sources do.
``eval_samples()`` gives the held-out prompts for ``adapters.slime.rollout``'s evaluation.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from adapters.common.config import titan_config_from_args
from adapters.peers import import_peer

_ds = import_peer("slime.rollout.data_source")
_types = import_peer("slime.utils.types")


class TitanPromptSource(_ds.DataSource):
    def __init__(self, args: Any) -> None:
        from titan_rl.data import PromptSampler, load_prompts

        self.args = args
        cfg = titan_config_from_args(args)
        seed = args.rollout_seed
        self._train = load_prompts(cfg.data, seed, "train")
        self._eval = load_prompts(cfg.data, seed, "eval")
        self.sampler = PromptSampler(self._train.prompts, seed)
        self.group_index = 0
        self.sample_index = 0

    def _sample(self, prompt: Any) -> Any:
        return _types.Sample(prompt=prompt.text, label=prompt.label, metadata=dict(prompt.metadata))

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """``num_samples`` prompts, each as a group of ``n_samples_per_prompt`` samples."""
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
        raise NotImplementedError("TitanPromptSource keeps no buffer of returned samples")

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
