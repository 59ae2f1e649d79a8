"""The 1-bit optimizer family: Adam, 0/1 Adam and LAMB that communicate compressed.

See [Note: optimizers that exchange data themselves] in ``_base.py`` for how they meet
the engine, and [Note: compressed all-reduce] in ``shardwise/comm/_compressed.py`` for
what goes on the wire.
"""

from shardwise.optim.onebit._base import COMM_BACKEND_NAMES, CompressedOptimizer, refuse_with_zero
from shardwise.optim.onebit.adam import OneBitAdam
from shardwise.optim.onebit.lamb import OneBitLamb
from shardwise.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["COMM_BACKEND_NAMES", "CompressedOptimizer", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "refuse_with_zero"]
