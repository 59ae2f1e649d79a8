"""shardwise, its serving engine and the MII API import without the ``serve`` extra."""

import subprocess
import sys

BLOCKED = ("fastapi", "uvicorn", "prometheus_client", "starlette")


def test_shardwise_imports_without_the_serve_extra():
    code = (
        "import sys\n"
        f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
        "import shardwise, shardwise.serve, shardwise.mii, shardwise.serve._cli\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
