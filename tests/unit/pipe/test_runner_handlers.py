"""The stage runner's handler table covers the schedule action vocabulary exactly."""

from dataclasses import is_dataclass
from typing import get_args

import pytest

from shardwise.pipe import _actions
from shardwise.pipe._runner import HANDLERS, check_handlers
from shardwise.pipe.module import PipelineError


def _defined_actions() -> set[type]:
    return {
        value
        for value in vars(_actions).values()
        if isinstance(value, type) and is_dataclass(value) and value.__module__ == _actions.__name__
    }


def test_every_action_type_in_actions_has_a_handler():
    """Every action class defined in ``_actions.py`` is in the ``Action`` union and has a
    handler of the batch run; no handler is left for a type that is not an action."""
    declared = set(get_args(_actions.Action))
    assert _defined_actions() == declared, sorted(t.__name__ for t in _defined_actions() ^ declared)
    assert set(HANDLERS) == declared, sorted(t.__name__ for t in set(HANDLERS) ^ declared)
    for action_type, handler in HANDLERS.items():
        assert callable(handler) and handler.__qualname__.startswith("_BatchRun."), (action_type, handler)
    assert len({h.__qualname__ for h in HANDLERS.values()}) == len(HANDLERS)  # one handler per action type


def test_a_table_missing_an_action_fails_the_import_check():
    """The check run when ``_runner.py`` is imported names what is missing or foreign."""
    check_handlers(HANDLERS)
    table = dict(HANDLERS)
    del table[_actions.BackwardWeight]
    with pytest.raises(PipelineError, match=r"missing \['BackwardWeight'\], not actions none"):
        check_handlers(table)
    with pytest.raises(PipelineError, match=r"missing none, not actions \['int'\]"):
        check_handlers({**HANDLERS, int: print})
