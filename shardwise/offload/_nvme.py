"""The nvme tier's directory: checked, reserved and cleaned up.

A bad ``nvme_path`` must stop the job before the first step, with the reason and the fix,
not in the middle of one: the directory must exist, accept new files, and have room for
everything this rank will swap. The room is then reserved (``posix_fallocate``) so a disk
that fills up later cannot fail a swap-out mid-step. Every rank checks its own view of
the path and the ranks agree on the outcome, so all of them raise together (no rank is
left waiting in a collective).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


class SwapPathError(RuntimeError):
    """nvme_path is missing, not a directory, not writable, or too small."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def make_swap_dir(nvme_path: str, *, key: str, rank: int, need_bytes: int) -> Path:
    """Create this process's swap directory under ``nvme_path`` after checking the path.

    Args:
        nvme_path: the configured directory.
        key: the config key, for messages (``zero_optimization.offload_optimizer.nvme_path``).
        rank: this rank (names the directory).
        need_bytes: bytes this rank will swap.

    Raises:
        SwapPathError: naming the problem and the fix.
    """
    root = Path(nvme_path)
    if not root.exists():
        raise SwapPathError(
            f"{key}={nvme_path!r} does not exist; create it (mkdir -p {nvme_path}) or "
            f"set {key} to a directory on a fast local disk"
        )
    if not root.is_dir():
        raise SwapPathError(f"{key}={nvme_path!r} is not a directory; set {key} to a directory")
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"shardwise-swap-rank{rank}-", dir=root))
        probe = folder / ".probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise SwapPathError(
            f"cannot create swap files under {key}={nvme_path!r}: {exc.strerror}; make it "
            f"writable by this user or set {key} to a writable directory"
        ) from None
    free = shutil.disk_usage(root).free
    if need_bytes > free:
        shutil.rmtree(folder, ignore_errors=True)
        raise SwapPathError(
            f"{key}={nvme_path!r} has {_gib(free)} free but rank {rank} needs "
            f"{_gib(need_bytes)} for its swap files; free space there, point {key} at a "
            'larger disk, use more ranks, or offload to "cpu" instead'
        )
    _remove_at_exit(folder)
    return folder


def reserve(path: Path, nbytes: int, *, key: str) -> None:
    """Allocate ``nbytes`` for ``path`` now, so running out of space is a start-up error."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise SwapPathError(
            f"cannot reserve {_gib(nbytes)} for swap file {path} under {key}: "
            f"{exc.strerror}; free space there or point {key} at a larger disk"
        ) from None
    finally:
        os.close(fd)


_to_remove: set[Path] = set()


def _remove_at_exit(folder: Path) -> None:
    _to_remove.add(folder)


def remove_swap_dir(folder: Path) -> None:
    """Delete a swap directory (its contents are only valid within this process)."""
    shutil.rmtree(folder, ignore_errors=True)
    _to_remove.discard(folder)


@atexit.register
def _cleanup() -> None:
    for folder in list(_to_remove):
        shutil.rmtree(folder, ignore_errors=True)
