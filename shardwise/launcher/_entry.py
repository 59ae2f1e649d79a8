"""What each rank started by ``shardwise run`` executes: the user's script, with its
error recorded so the launcher can say which rank failed first and why.

Usage (by the node launcher, ``node.py``): ``python -m shardwise.launcher._entry script.py args``,
or ``... _entry -m package.module args`` (``shardwise run --module``).
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import sys
import traceback
from pathlib import Path

from shardwise.launcher.environment import NO_LOCAL_RANK_ENV


def main() -> None:
    argv = sys.argv[1:]
    module = bool(argv) and argv[0] == "-m"  # shardwise run --module: the target is a module
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m shardwise.launcher._entry [-m MODULE | SCRIPT] [ARGS...]")
    target, args = argv[0], argv[1:]
    if os.environ.get(NO_LOCAL_RANK_ENV) != "1":
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]  # first, as DeepSpeed's launcher
    sys.argv = [target, *args]  # run_module puts the module's file in argv[0], as python -m does
    sys.path.insert(0, os.getcwd() if module else str(Path(target).resolve().parent))
    # a rank that crashes hard (SIGSEGV, SIGABRT from native code) prints every thread's
    # Python stack to stderr, so the launcher's "crashed hard" report shows where
    faulthandler.enable(all_threads=True)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record_error(f"SystemExit({exc.code!r})")
            _note_failure(exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException:
        _record_error(traceback.format_exc())
        raise


def _record_error(message: str) -> None:
    # imported here: shardwise.comm imports torch, which a script that never fails may not need
    from shardwise.comm._error_record import record_error

    record_error(message)


def _note_failure(status: int) -> None:
    # A failing rank skips the exit barrier (see [Note: exit after a failure] in
    # comm/_exit.py); an uncaught exception is seen there by itself, a SystemExit is not.
    if "shardwise.comm._exit" in sys.modules:
        sys.modules["shardwise.comm._exit"].note_failure(status)


if __name__ == "__main__":
    main()
