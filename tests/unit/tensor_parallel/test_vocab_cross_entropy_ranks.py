"""The vocab-parallel cross-entropy at four tensor ranks, by value: each rank finds the
targets of its own vocabulary chunk at the right offset (see [Note: vocab-parallel
softmax]), including the first and last index of every chunk.

The ranks are threads of this process over a stand-in group whose all-reduce really
reduces (no process group), so the check costs milliseconds.
"""

import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.comm import Communicator
from shardwise.tensor_parallel import vocab_parallel_cross_entropy

TP, LOCAL = 4, 4
VOCAB = TP * LOCAL


class _ThreadGroup:
    """What the ranks share: every all-reduce waits for all of them, then each reads the result."""

    def __init__(self, world_size):
        self.barrier = threading.Barrier(world_size, timeout=10)
        self.deposits: dict[int, torch.Tensor] = {}


class _ThreadRank(Communicator):
    def __init__(self, group: _ThreadGroup, rank: int):
        self.group, self.rank, self.world_size, self.name = group, rank, TP, "tensor-parallel"

    def all_reduce(self, tensor, *, op=None, tag=""):
        self.group.deposits[self.rank] = tensor.clone()
        self.group.barrier.wait()
        stacked = torch.stack([self.group.deposits[r] for r in range(self.world_size)])
        tensor.copy_(stacked.amax(dim=0) if op == dist.ReduceOp.MAX else stacked.sum(dim=0))
        self.group.barrier.wait()  # every rank has read the deposits before the next collective
        return _Done()


class _Done:
    def wait(self):
        pass


def _run_ranks(logits, target, label_smoothing):
    group, results, errors = _ThreadGroup(TP), {}, []

    def rank_body(rank):
        try:
            chunk = logits.detach()[..., rank * LOCAL : (rank + 1) * LOCAL].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(chunk, target, _ThreadRank(group, rank), label_smoothing)
            loss.sum().backward()
            results[rank] = (loss.detach(), chunk.grad)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_body, args=(rank,)) for rank in range(TP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def test_every_rank_finds_its_targets_at_its_chunks_offset():
    # every vocabulary index is a target once: the first and last of each rank's chunk too
    target = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0)).view(2, 8)
    logits = torch.randn(2, 8, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    for smoothing in (0.0, 0.1):
        reference = logits.clone().requires_grad_()
        want = F.cross_entropy(
            reference.view(-1, VOCAB), target.view(-1), reduction="none", label_smoothing=smoothing
        ).view(2, 8)
        want.sum().backward()
        results = _run_ranks(logits, target, smoothing)
        for rank, (loss, grad) in sorted(results.items()):
            torch.testing.assert_close(loss, want.detach(), msg=f"rank {rank} eps={smoothing}: loss")
            torch.testing.assert_close(
                grad,
                reference.grad[..., rank * LOCAL : (rank + 1) * LOCAL],
                msg=f"rank {rank} eps={smoothing}: gradient of its chunk",
            )
