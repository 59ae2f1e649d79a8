"""``WandbMonitor``: events logged to a Weights & Biases run (``WANDB_MODE=offline`` keeps the
run on disk, without network)."""

from __future__ import annotations

from collections import defaultdict

from shardwise.monitor.monitor import Monitor, require_package


class WandbMonitor(Monitor):
    """Starts a run with ``wandb.init(project=, group=, entity=team)`` and logs the events of
    each step in one ``wandb.log({tag: value, ...}, step=step)`` call.

    Args:
        wandb_config: the ``wandb`` section (``WandbConfig``).
    """

    def __init__(self, wandb_config):
        super().__init__(wandb_config)
        self.check_available()
        import wandb

        self.group, self.team, self.project = wandb_config.group, wandb_config.team, wandb_config.project
        self.run = wandb.init(project=self.project, group=self.group, entity=self.team)

    @staticmethod
    def check_available() -> None:
        require_package("wandb", "the Weights & Biases monitor ('wandb' section)")

    def log(self, data: dict, step: int | None = None, commit: bool | None = None):
        """``wandb.log`` on this monitor's run."""
        return self.run.log(data, step=step, commit=commit)

    def write_events(self, event_list) -> None:
        by_step: dict[int, dict] = defaultdict(dict)
        for tag, value, step in event_list:
            by_step[step][tag] = value
        for step in sorted(by_step):
            self.log(by_step[step], step=step)

    def close(self) -> None:
        self.run.finish()
