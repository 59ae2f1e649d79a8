"""Optimizers by name, and the ones torch does not ship (Lamb)."""

from shardwise.optim.build import build_optimizer
from shardwise.optim.lamb import Lamb

__all__ = ["Lamb", "build_optimizer"]
