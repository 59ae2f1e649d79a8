"""``csvMonitor`` (DeepSpeed's spelling; ``CSVMonitor`` too): one CSV file per tag."""

from __future__ import annotations

import csv
import os

from shardwise.monitor._files import prepare_log_dir
from shardwise.monitor.monitor import Monitor


class csvMonitor(Monitor):  # noqa: N801 - DeepSpeed's name
    """Appends ``step,value`` rows to ``output_path/job_name/<tag>.csv``, the tag's ``/`` and
    spaces made ``_``; a new file starts with the header ``step,<last part of the tag>``.

    Args:
        csv_config: the ``csv_monitor`` section (``FileMonitorConfig``).
    """

    def __init__(self, csv_config):
        super().__init__(csv_config)
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = prepare_log_dir("csv_monitor", self.output_path, self.job_name)

    @staticmethod
    def check_available() -> None:
        """The csv module is part of Python."""

    def path_of(self, tag: str) -> str:
        """The file a tag's rows go to."""
        return os.path.join(self.log_dir, tag.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, event_list) -> None:
        for tag, value, step in event_list:
            path = self.path_of(tag)
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as file:
                writer = csv.writer(file)
                if new:
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
                writer.writerow([step, value])


CSVMonitor = csvMonitor
