"""Optimizers by name, and the ones torch does not ship (Lamb, Lion, the 1-bit family)."""

from shardwise.optim.build import build_optimizer
from shardwise.optim.lamb import Lamb
from shardwise.optim.lion import Lion
from shardwise.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

__all__ = ["Lamb", "Lion", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "build_optimizer"]
