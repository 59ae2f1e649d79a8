"""A ``sys.exit`` that ends the main thread with a non-zero status counts as a failure at
exit; one that is caught, that ends only a thread, or whose status is 0 does not (see
[Note: seeing a SystemExit]).

Every case needs an interpreter of its own that ends as the case says. To import torch
once, one driver script forks a child per case; the child installs the exit hooks, runs
the case at the driver's top level and reports what the exit hook would decide."""

import subprocess
import sys

_DRIVER = """
import atexit, os, sys, threading
from shardwise.comm import _exit

CASES = {
    "top level": "sys.exit(3)",
    "in a with block, from a function": "def main():\\n    sys.exit(4)\\nwith open(__file__):\\n    main()",
    "main() returns 0": "def main():\\n    return 0\\nsys.exit(main())",
    "a message": "sys.exit('bad input')",
    "caught, then the script ends": "try:\\n    sys.exit(2)\\nexcept SystemExit:\\n    pass",
    "in a thread only": "t = threading.Thread(target=sys.exit, args=(5,))\\nt.start()\\nt.join()",
}
for name, body in CASES.items():
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        _exit.install_exit_hooks()
        # Registered after the hooks, so it runs before shardwise's exit hook.
        atexit.register(lambda: print(f"{name}: failure status {_exit.failure_status()}", flush=True))
        exec(body)
        break  # the case ended normally: so does this child's top level
    _, wait_status = os.waitpid(pid, 0)
    print(f"{name}: exit code {os.waitstatus_to_exitcode(wait_status)}", flush=True)
"""

_EXPECTED = {  # exit code, failure status seen by the exit hook
    "top level": (3, 3),
    "in a with block, from a function": (4, 4),
    "main() returns 0": (0, None),
    "a message": (1, 1),
    "caught, then the script ends": (0, None),
    "in a thread only": (0, None),
}


def test_the_exit_hook_sees_a_sys_exit_that_ends_the_main_thread(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = set(proc.stdout.splitlines())
    for name, (exit_code, status) in _EXPECTED.items():
        assert f"{name}: exit code {exit_code}" in lines, proc.stdout + proc.stderr
        assert f"{name}: failure status {status}" in lines, proc.stdout + proc.stderr
