"""The built-in engine serves the model families the trainer maps to HF names: one table
(``titan_core.models.hf.families.FAMILIES``) says which, for both."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_core.models.hf.families import FAMILIES
from titan_rl.engine.core import Engine


def _config_only(path: Path, model_type: str) -> Path:
    """A model folder with just its config.json: the engine checks the type before loading."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32).save_pretrained(path)
    return path


def test_a_model_type_outside_the_table_is_refused_naming_the_table(tmp_path: Path) -> None:
    path = _config_only(tmp_path, "mistral")
    with pytest.raises(ValueError, match="'mistral' is not supported") as err:
        Engine(str(path), load_tokenizer=False)
    assert str(sorted(FAMILIES)) in str(err.value)


def test_a_family_the_table_drops_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine asks the trainer's table itself, not a list of its own."""
    monkeypatch.delitem(FAMILIES, "qwen2")
    path = _config_only(tmp_path, "qwen2")
    with pytest.raises(ValueError, match="'qwen2' is not supported") as err:
        Engine(str(path), load_tokenizer=False)
    assert "qwen2" not in str(err.value).split("supported:")[1]
