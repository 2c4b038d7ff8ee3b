"""megatron-core GPT and MoE models built from Titan's config."""
