"""What the rank pool's fork server imports once, before it forks any rank ([Note: the rank
pool]): torch, the whole of shardwise and ``torch._dynamo``, which torch's optimizers
import on their first construction (about 2 s of CPU in every fresh process). A rank forked
from the server starts with all of it, single-threaded: importing these starts no thread."""

import os

os.environ.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401

import shardwise  # noqa: E402

dir(shardwise)  # the lazy package's whole API ([Note: lazy package import])
torch.set_num_threads(1)
