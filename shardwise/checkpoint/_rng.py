"""Capture and restore the process's random number generators for exact resumption.

The captured state is a dict of tensors and plain data that ``flatten_state`` stores
as is; the large parts (Mersenne Twister keys, generator states) are tensors so that
they go to the safetensors file rather than into the JSON manifest.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import torch

from shardwise.checkpoint._format import CheckpointError

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator this process uses, ready for ``flatten_state``.

    Holds Python's ``random`` module, numpy's global generator (when numpy is
    importable), torch's CPU generator and, when CUDA has been initialised in this
    process, the generator of every visible CUDA device. Call it after the step whose
    random numbers were consumed, on every rank: each rank has its own streams.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    numpy = _numpy()
    if numpy is not None:
        name, key, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": str(name),
            "key": torch.from_numpy(key.astype(numpy.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    # All devices' generators (the accelerator's RNG calls address one device); CUDA is
    # touched only if already in use, so a CPU job never initialises it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put every generator back into the state ``capture_rng_state`` returned.

    Generators absent from ``state`` are left alone. Saved CUDA states are skipped with a
    warning when CUDA is unavailable, and applied to the first devices when the device
    count differs; numpy's state is skipped with a warning when numpy is not importable.

    Raises:
        CheckpointError: ``state`` is malformed (not from ``capture_rng_state``).
    """
    try:
        python = state["python"]
        random.setstate(
            (int(python["version"]), tuple(int(v) for v in python["internal"].tolist()), python["gauss_next"])
        )
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            _restore_numpy(state["numpy"])
        if "cuda" in state:
            _restore_cuda(list(state["cuda"]))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(
            f"the saved random number generator state is malformed ({exc!r}); "
            "the checkpoint was damaged or not written by capture_rng_state; "
            "load an earlier tag or re-save"
        ) from exc


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _restore_numpy(saved: Mapping[str, Any]) -> None:
    numpy = _numpy()
    if numpy is None:
        logger.warning(
            "the checkpoint holds numpy's random state but numpy is not installed; "
            "numpy's random stream is not restored"
        )
        return
    key = saved["key"].numpy().astype(numpy.uint32)
    numpy.random.set_state(
        (saved["bit_generator"], key, int(saved["pos"]), int(saved["has_gauss"]), float(saved["cached_gaussian"]))
    )


def _restore_cuda(saved: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        logger.warning(
            "the checkpoint holds CUDA random states but CUDA is not available; CUDA random streams are not restored"
        )
        return
    count = torch.cuda.device_count()
    if count != len(saved):
        logger.warning(
            "the checkpoint holds CUDA random states for %d devices but %d are visible; restoring the first %d",
            len(saved),
            count,
            min(count, len(saved)),
        )
    for index, generator_state in enumerate(saved[:count]):
        torch.cuda.set_rng_state(generator_state, device=index)
