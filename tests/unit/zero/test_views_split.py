"""The ZeRO interfaces are split: the strategies implement the step (``ZeroStrategy``) and
hold their state and checkpoint views as ``strategy.views`` (``ZeroViews``), so no view is
implemented, or overridden, on a strategy."""

import pytest

from shardwise.zero import ShardedStrategy, Stage0Strategy, Stage3Strategy, ZeroStrategy, ZeroViews
from shardwise.zero._views import ShardedViews, Stage0Views, Stage3Views


def _methods(protocol) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


VIEWS = _methods(ZeroViews)


def test_the_protocols_split_lifecycle_from_views():
    assert _methods(ZeroStrategy) == {
        "optimizer_params",
        "without_optimizer",
        "pre_backward",
        "finalize_backward",
        "step",
        "zero_grad",
        "release_gathered",
    }
    assert len(VIEWS) == 18 and not VIEWS & _methods(ZeroStrategy)


@pytest.mark.parametrize("views", [Stage0Views, ShardedViews, Stage3Views])
def test_every_views_class_implements_every_view(views):
    assert all(callable(getattr(views, name, None)) for name in VIEWS), VIEWS - set(dir(views))


@pytest.mark.parametrize("strategy", [Stage0Strategy, ShardedStrategy, Stage3Strategy])
def test_no_strategy_implements_a_view(strategy):
    assert not VIEWS & set(dir(strategy))
