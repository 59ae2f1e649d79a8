"""Mixed precision: the loss scaler and the dtype policy."""

from shardwise.precision.loss_scale import LossScaler
from shardwise.precision.policy import PrecisionPolicy

__all__ = ["LossScaler", "PrecisionPolicy"]
