"""What each rank started by ``shardwise run`` executes: the user's script, with its
error recorded so the launcher can say which rank failed first and why.

Usage (by the node launcher, ``node.py``): ``python -m shardwise.launcher._entry script.py args``.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import sys
import traceback
from pathlib import Path

from shardwise.comm._error_record import record_error
from shardwise.launcher.environment import NO_LOCAL_RANK_ENV


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m shardwise.launcher._entry SCRIPT [ARGS...]")
    script, args = sys.argv[1], sys.argv[2:]
    if os.environ.get(NO_LOCAL_RANK_ENV) != "1":
        args = [*args, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    # a rank that crashes hard (SIGSEGV, SIGABRT from native code) prints every thread's
    # Python stack to stderr, so the launcher's "crashed hard" report shows where
    faulthandler.enable(all_threads=True)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            record_error(f"SystemExit({exc.code!r})")
            _note_failure(exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException:
        record_error(traceback.format_exc())
        raise


def _note_failure(status: int) -> None:
    # A failing rank skips the exit barrier (see [Note: exit after a failure] in
    # comm/_exit.py); an uncaught exception is seen there by itself, a SystemExit is not.
    if "shardwise.comm._exit" in sys.modules:
        sys.modules["shardwise.comm._exit"].note_failure(status)


if __name__ == "__main__":
    main()
