"""Data efficiency: curriculum learning, data sampling and data routing (random-LTD)."""
