"""The Megatron policy trainer (one object per rank) and its Ray actor group."""
