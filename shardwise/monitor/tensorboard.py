"""``TensorBoardMonitor``: events as TensorBoard scalars, through ``torch.utils.tensorboard``."""

from __future__ import annotations

from shardwise.monitor._files import prepare_log_dir
from shardwise.monitor.monitor import Monitor, require_package


class TensorBoardMonitor(Monitor):
    """Writes each ``(tag, value, step)`` with ``SummaryWriter.add_scalar`` into
    ``output_path/job_name`` and flushes after every batch of events.

    Args:
        tensorboard_config: the ``tensorboard`` section (``FileMonitorConfig``).
    """

    def __init__(self, tensorboard_config):
        super().__init__(tensorboard_config)
        self.check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.log_dir = prepare_log_dir("tensorboard", self.output_path, self.job_name)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    @staticmethod
    def check_available() -> None:
        require_package("tensorboard", "the TensorBoard monitor ('tensorboard' section)")

    def get_summary_writer(self, base=None):
        """The ``SummaryWriter`` (DeepSpeed's accessor; ``base``, DeepSpeed's fallback
        directory for a None ``output_path``, is never used: the path is a string)."""
        del base
        return self.summary_writer

    def write_events(self, event_list, flush: bool = True) -> None:
        for tag, value, step in event_list:
            self.summary_writer.add_scalar(tag, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()
