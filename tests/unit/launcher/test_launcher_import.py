"""``import shardwise`` is lazy ([Note: lazy package import]): the launcher's process
(``shardwise run``, which only starts torchrun and waits) never imports torch, and the
first attribute read on the package imports the whole public API."""

import subprocess
import sys


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_the_launcher_does_not_import_torch():
    code = "import sys, shardwise.cli, shardwise.launcher; print('torch' in sys.modules)"
    assert _run(code) == "False"


def test_the_first_attribute_read_imports_the_public_api():
    code = (
        "import sys, shardwise; before = 'shardwise.runtime.engine' in sys.modules; "
        "from shardwise import initialize; print(before, callable(initialize), "
        "callable(shardwise.runtime.utils.set_random_seed), 'shardwise.runtime.engine' in sys.modules)"
    )
    assert _run(code) == "False True True True"
