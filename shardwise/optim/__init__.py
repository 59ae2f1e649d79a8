"""Optimizers by name, and the ones torch does not ship (Lamb, Lion)."""

from shardwise.optim.build import build_optimizer
from shardwise.optim.lamb import Lamb
from shardwise.optim.lion import Lion

__all__ = ["Lamb", "Lion", "build_optimizer"]
