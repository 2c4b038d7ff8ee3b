"""Whether an HF directory's weight files can be read, asked where the directory is named
(config load, a driver's flags) rather than when a trainer rank or an engine first opens
them, minutes later and with a library's traceback."""

from __future__ import annotations

from pathlib import Path

from titan_core.config.loader import ConfigError


def check_safetensors(path: str | Path, named_by: str) -> None:
    """Each ``*.safetensors`` file in the directory ``path`` opens: its header is whole and
    its tensors cover the file. A truncated or damaged file (a copy or download cut short)
    is a :class:`ConfigError` naming the file and ``named_by``, the key or flag that gave
    ``path``. Only the headers are read."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ConfigError(
                f"{named_by}: {f} cannot be read ({e}); the file is damaged or was not fully "
                "written: copy or download it again"
            ) from None
