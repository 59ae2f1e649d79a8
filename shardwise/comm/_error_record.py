"""Each rank's error record, which ``shardwise run`` reads to say which rank failed first.

It sits in comm, below the launcher, because comm writes one too (a hang found by
``_hang_watch.py`` ends the process where no exception can carry it), and the launcher's
entry wrapper writes the rest.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ERROR_DIR_ENV = "SHARDWISE_ERROR_DIR"
"""Where each rank records the error that ended it, for the launcher's report."""


def record_error(message: str) -> None:
    """Write this rank's error for the launcher (which prints the earliest one); nothing
    when the process was not started by ``shardwise run``."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return
    rank = os.environ.get("RANK", "?")
    try:
        Path(folder, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "local_rank": os.environ.get("LOCAL_RANK"),
                    "host": os.uname().nodename,
                    "time": time.time(),
                    "error": message[-4000:],
                }
            )
        )
    except OSError:
        pass
