"""``CometMonitor``: events logged to a Comet ML experiment."""

from __future__ import annotations

from shardwise.monitor.monitor import Monitor, require_package


class CometMonitor(Monitor):
    """Starts an experiment with ``comet_ml.start(...)`` (the section's api_key, project,
    workspace, experiment_key, mode, online) and logs each tag with ``log_metric`` at most
    once every ``samples_log_interval`` samples.

    Args:
        comet_config: the ``comet`` section (``CometConfig``).
    """

    def __init__(self, comet_config):
        super().__init__(comet_config)
        self.check_available()
        import comet_ml

        self.samples_log_interval = comet_config.samples_log_interval
        self._last_logged: dict[str, int] = {}
        self.experiment = comet_ml.start(
            api_key=comet_config.api_key,
            project=comet_config.project,
            workspace=comet_config.workspace,
            experiment_key=comet_config.experiment_key,
            mode=comet_config.mode,
            online=comet_config.online,
        )
        if comet_config.experiment_name is not None:
            self.experiment.set_name(comet_config.experiment_name)

    @staticmethod
    def check_available() -> None:
        require_package("comet_ml", "the Comet monitor ('comet' section)", extra="comet")

    def write_events(self, event_list) -> None:
        for tag, value, step in event_list:
            last = self._last_logged.get(tag)
            if last is None or step - last >= self.samples_log_interval:
                self._last_logged[tag] = step
                self.experiment.log_metric(tag, value, step=step)

    def close(self) -> None:
        self.experiment.end()
