"""``deepspeed.pipe``: pipeline parallelism.

``PipelineModule`` / ``LayerSpec`` / ``TiedLayerSpec`` describe the model as a list of
layers cut into stages (``module.py``); schedules are pure action lists (``schedules.py``);
``PipelineEngine`` (``engine.py``, DeepSpeed's names) runs them through its stage runner
(``_runner.py``). The process topologies live in
``shardwise.parallel`` (the grid every parallelism shares) and are re-exported here where
DeepSpeed's users import them.
"""

from shardwise.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from shardwise.pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineError",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]
