"""A 2-stage pipeline job whose last stage stalls inside step 2 (as a stage stuck in a
data loader or a dead GPU would): the first stage must fail within the deadline, naming
what it waited for, and the whole job must end."""

import sys
import time

import torch
from torch import nn

import shardwise
from shardwise.pipe import LayerSpec, PipelineModule

shardwise.init_distributed()


class Stall(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 5 and torch.distributed.get_rank() == 1:  # step 2, first micro-batch
            time.sleep(600)
        return x


# the deadline, the one argument (shardwise run puts --local_rank=N before it, as DeepSpeed's launcher)
timeout_s = float(next(arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")))
layers = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Linear, 8, 8), LayerSpec(Stall)]
model = PipelineModule(layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method=[0, 1, 3])
engine, *_ = shardwise.initialize(
    model=model,
    config={
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "comm": {"timeout_s": timeout_s},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    },
)
data = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(12)]
for step in range(3):
    engine.train_batch(iter(data[step * 4 : (step + 1) * 4]))
print("FINISHED", flush=True)
