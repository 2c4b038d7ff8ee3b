"""HF <-> megatron-core weight mapping for Llama, Qwen2, Qwen3 and Qwen3-MoE."""

from titan_core.models.hf.convert import (
    HFBridge,
    SendRole,
    export_hf_weights,
    load_hf_weights,
    model_config_from_hf,
    read_hf_config,
)

__all__ = [
    "HFBridge",
    "SendRole",
    "export_hf_weights",
    "load_hf_weights",
    "model_config_from_hf",
    "read_hf_config",
]
