"""Every script in bench/ loads: its imports resolve and its argument parser builds.

The bench scripts are not run by the suite (they are minutes long), so a refactor that
moves a helper they import would otherwise break them silently; this test runs each
script's ``--help`` as its ``__main__``, all of them in one subprocess (one Python start
and one import of torch, instead of one per script).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))

_RUN_EACH = r"""
import contextlib, io, json, runpy, sys, traceback
bench, scripts = sys.argv[1], sys.argv[2:]
sys.path.insert(0, bench)
results = {}
for script in scripts:
    sys.argv = [f"{bench}/{script}", "--help"]
    out, err, code = io.StringIO(), "", 0
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        code, err = 1, traceback.format_exc()
    results[script] = {"code": code, "stdout": out.getvalue(), "error": err}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps():
    proc = subprocess.run([sys.executable, "-c", _RUN_EACH, str(BENCH), *SCRIPTS], capture_output=True, text=True,
                          timeout=300, cwd=BENCH.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_bench_folder_has_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_help_runs(helps, script):
    result = helps[script]
    assert result["code"] == 0, f"bench/{script} --help failed:\n{result['error'][-2000:]}"
    assert "usage" in result["stdout"].lower()
