"""The multi-process test harness: run a body on N gloo ranks on CPU."""

from shardwise.testing._harness import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
