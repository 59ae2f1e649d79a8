"""Data efficiency: curriculum scheduling, data sampling and data routing (DeepSpeed-compatible)."""
