"""RL post-training (GRPO and friends) on Titan's training base."""
