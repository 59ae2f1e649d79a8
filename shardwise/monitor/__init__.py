"""Monitors: where a run's scalars go (TensorBoard, Weights & Biases, CSV, Comet), at
DeepSpeed's ``deepspeed.monitor`` paths. The engine writes to ``engine.monitor``, a
``MonitorMaster``; see ``monitor.py``."""

from shardwise.monitor.comet import CometMonitor
from shardwise.monitor.csv_monitor import CSVMonitor, csvMonitor
from shardwise.monitor.monitor import Monitor, MonitorMaster
from shardwise.monitor.tensorboard import TensorBoardMonitor
from shardwise.monitor.wandb import WandbMonitor

__all__ = ["CSVMonitor", "CometMonitor", "Monitor", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]
