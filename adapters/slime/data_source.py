"""``TitanPromptSource``: a slime ``DataSource`` (``--data-source-path``, this driver's
default) over the Titan YAML's prompts (``adapters.common.prompt_source``). slime's own
``RolloutDataSourceWithBuffer`` works too where ``--hf-checkpoint`` has an HF tokenizer."""

from __future__ import annotations

from adapters.common.prompt_source import TitanPrompts
from adapters.peers import import_peer

_ds = import_peer("slime.rollout.data_source")
_types = import_peer("slime.utils.types")


class TitanPromptSource(TitanPrompts, _ds.DataSource):
    sample_type = _types.Sample
