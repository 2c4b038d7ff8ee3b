"""``TitanPromptSource``: a miles data source (``--data-source-path``, this driver's
default) over the Titan YAML's prompts (``adapters.common.prompt_source``), with the
methods miles' rollout manager calls. miles' own sources (``miles.rollout.data_source``)
import ``sglang`` at the top."""

from __future__ import annotations

from adapters.common.prompt_source import TitanPrompts
from adapters.peers import import_peer

_types = import_peer("miles.utils.types")


class TitanPromptSource(TitanPrompts):
    sample_type = _types.Sample
