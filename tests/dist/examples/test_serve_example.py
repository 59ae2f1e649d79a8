"""``examples/serve_openai.py`` starts a server on a tiny Llama and gets the same text through a
completion, its stream and a chat with the ``openai`` client."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def test_serve_example_queries_its_server(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    command = [sys.executable, str(REPO / "examples" / "serve_openai.py")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    texts = dict(re.findall(r"^(completion|streamed|chat): +'([^']*)'", proc.stdout, re.M))
    assert texts.keys() == {"completion", "streamed", "chat"}, proc.stdout
    assert texts["completion"] == texts["streamed"] != ""
