"""The error record a rank leaves for ``shardwise run``, and comm's place below the launcher."""

import ast
import json
from pathlib import Path

import shardwise.comm
from shardwise.comm import _hang_watch
from shardwise.comm._error_record import ERROR_DIR_ENV, record_error
from shardwise.launcher import _entry
from shardwise.launcher import node as node_launcher


def test_the_record_names_the_rank_and_keeps_the_errors_tail(tmp_path, monkeypatch):
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    record_error("x" * 5000 + "CollectiveError: the end")
    saved = json.loads((tmp_path / "rank3.json").read_text())
    assert (saved["rank"], saved["local_rank"]) == ("3", "1")
    assert len(saved["error"]) == 4000 and saved["error"].endswith("CollectiveError: the end")


def test_without_the_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_error("lost")
    assert list(tmp_path.iterdir()) == []


def test_the_launcher_and_the_hang_watch_share_one_record(tmp_path, monkeypatch):
    assert _hang_watch.record_error is record_error
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    _entry._record_error("from the entry wrapper")  # imports comm's record only when a script fails
    assert json.loads((tmp_path / "rank2.json").read_text())["error"] == "from the entry wrapper"
    assert node_launcher.ERROR_DIR_ENV == ERROR_DIR_ENV == "SHARDWISE_ERROR_DIR"


def test_comm_imports_nothing_from_the_launcher():
    imported = set()
    for path in Path(shardwise.comm.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add((path.name, node.module))
            elif isinstance(node, ast.Import):
                imported.update((path.name, alias.name) for alias in node.names)
    assert [pair for pair in imported if pair[1].startswith("shardwise.launcher")] == []
    assert ("_hang_watch.py", "shardwise.comm._error_record") in imported
