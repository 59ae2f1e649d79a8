"""Every script in bench/ loads: its imports resolve and its argument parser builds.

The bench scripts are not run by the suite (they are minutes long), so a refactor that
moves a helper they import would otherwise break them silently; this test runs each
script's ``--help`` in one subprocess per script.
"""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))


def test_the_bench_folder_has_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_help_runs(script):
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120, cwd=BENCH.parent
    )
    assert proc.returncode == 0, f"bench/{script} --help failed:\n{proc.stderr[-2000:]}"
    assert "usage" in proc.stdout.lower()
