"""The weights the engines serve at start-up, ``<run.dir>/hf_start``.

The trainer writes them (an HF export of the policy it loaded or resumed) once it is built,
so the engines can only start after it. A fresh run from an HF policy need not wait: the
export would hold the policy's own tensors, so ``hf_start`` is made of them directly (links
to the policy's safetensors, its config.json and the run's tokenizer) and the engines start
while the trainer builds. That holds where every tensor is exactly representable in the
trainer's parameter dtype (the same dtype, or a 16-bit one upcast to fp32) and the engine's
dtype resolves the same on both (its ``engines.dtype``; with ``auto``, the dtype config.json
declares, copied unchanged into both): it then computes on identical values.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from titan_core.checkpoint.dist import RELEASE, latest_iteration
from titan_core.models.hf import read_hf_config

if TYPE_CHECKING:
    from titan_rl.config import GRPOConfig

#: safetensors dtype names -> the trainer's
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
#: what each trainer parameter dtype holds exactly, besides itself
_EXACT_IN = {"float32": {"bfloat16", "float16"}, "bfloat16": set(), "float16": set()}


def start_dir(cfg: GRPOConfig) -> Path:
    return Path(cfg.run.dir) / "hf_start"


def trainer_dtype(cfg: GRPOConfig) -> str:
    """The dtype of the trainer's parameters, which its HF export writes."""
    if cfg.train.bf16:
        return "bfloat16"
    return "float16" if cfg.train.fp16 else "float32"


def _resumes(cfg: GRPOConfig) -> bool:
    """The run has a checkpoint to resume from (a damaged one too: the trainer's resume
    reports it)."""
    try:
        it = latest_iteration(Path(cfg.run.dir) / "checkpoints")
    except Exception:
        return True
    return it is not None and it != RELEASE


def _weight_files(policy: Path) -> list[Path]:
    return sorted(policy.glob("*.safetensors"))


def _policy_dtypes(files: list[Path]) -> set[str] | None:
    """The dtypes of the policy's tensors (None: one the engines do not take)."""
    seen: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                dtype = _DTYPES.get(st.get_slice(name).get_dtype())
                if dtype is None:
                    return None
                seen.add(dtype)
    return seen


def serves_policy_files(cfg: GRPOConfig) -> bool:
    """Whether the engines can serve the HF policy's own files at start-up (see the module's
    docstring): False where they must wait for the trainer's export (a Titan checkpoint, a
    resumed run, a policy the trainer holds in a narrower dtype, or where the engine's
    ``dtype: auto`` would resolve differently on the files than on the export)."""
    if cfg.policy.format != "hf" or _resumes(cfg):
        return False
    policy = Path(cfg.policy.load)
    files = _weight_files(policy)
    dtypes = _policy_dtypes(files) if files else None
    if not dtypes:
        return False
    held = trainer_dtype(cfg)
    if not dtypes <= {held} | _EXACT_IN[held]:  # the export's values would differ
        return False
    if cfg.engines.dtype != "auto" or dtypes == {held}:
        return True
    # "auto" follows the config's declared dtype, the same in both; without one, the
    # weights' own, which the export changes (the upcast)
    hf = read_hf_config(policy)
    return bool(hf.get("dtype") or hf.get("torch_dtype"))


def clear_start_dir(cfg: GRPOConfig) -> Path:
    """An empty ``hf_start`` (what an earlier run left there, links or an export, goes)."""
    out = start_dir(cfg)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def link_policy(cfg: GRPOConfig, tokenizer: object) -> Path:
    """``hf_start`` as the HF policy's own weights and config, with the run's tokenizer (the
    one the trainer's export writes beside its weights)."""
    policy = Path(cfg.policy.load).resolve()
    out = clear_start_dir(cfg)
    for f in [*_weight_files(policy), *policy.glob("*.safetensors.index.json")]:
        (out / f.name).symlink_to(f)
    shutil.copy(policy / "config.json", out / "config.json")
    tokenizer.save_hf(out)  # type: ignore[attr-defined]
    return out
