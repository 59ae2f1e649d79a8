"""The directory of a file-writing monitor, made and checked at start-up."""

from __future__ import annotations

import os
import tempfile


def prepare_log_dir(section: str, output_path: str, job_name: str) -> str:
    """``output_path/job_name``, created; raises ValueError naming the section when it
    cannot be made or written, so a bad path fails at initialize and not mid-run."""
    log_dir = os.path.join(output_path, job_name)
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as error:
        raise ValueError(
            f"{section}.output_path: cannot write to {log_dir!r} ({error.strerror or error}); "
            f"set {section}.output_path to a writable directory"
        ) from None
    return log_dir
