"""Checks of a pretraining config against the file system, run right after the config is
loaded and before any process group or model is built: a mistake costs seconds, not a
cluster start-up, and comes out as ``error: ...`` with exit code 2."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from titan_core.config import ConfigError
from titan_core.config.pretrain import PretrainConfig


def output_dirs(cfg: PretrainConfig) -> dict[str, str]:
    """The folders a run writes to, by the key that names them."""
    dirs = {"run.dir": cfg.run.dir}
    if cfg.checkpoint.save:
        dirs["checkpoint.save"] = cfg.checkpoint.save
    if cfg.data.cache_dir:
        dirs["data.cache_dir"] = cfg.data.cache_dir
    if cfg.profile.steps and cfg.profile.dir:
        dirs["profile.dir"] = cfg.profile.dir
    return dirs


def check_writable(key: str, folder: str) -> None:
    """Create ``folder`` if needed and write a file in it (permission bits alone do not tell:
    root ignores them, a read-only mount does not show in them)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(
            f"{key} {folder} is not a writable folder ({e.strerror or e}); choose another {key}"
        ) from None


def check_startup(cfg: PretrainConfig) -> None:
    """Output folders are writable and the data is usable (see titan_core.data.checks)."""
    from titan_core.data.checks import check_data

    for key, folder in output_dirs(cfg).items():
        check_writable(key, folder)
    check_data(cfg, rank=int(os.environ.get("RANK", "0")))
