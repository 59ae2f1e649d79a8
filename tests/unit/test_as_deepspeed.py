"""``shardwise.install_as_deepspeed()``: ``import deepspeed`` gives shardwise's modules.

Each check runs in a fresh interpreter: the alias changes ``sys.meta_path`` for good,
and what it is checked against (accelerate, transformers) decides at import time.
"""

import json
import subprocess
import sys
import textwrap

import pytest


def _run(body: str, *, path: str | None = None) -> dict:
    """Run ``body`` in a fresh interpreter (``path`` first on sys.path); it sets ``out``."""
    code = (
        "import json, sys\n"
        + (f"sys.path.insert(0, {path!r})\n" if path else "")
        + "out = {}\n"
        + textwrap.dedent(body)
        + "\nprint(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_ALIAS_CHECKS = """
import importlib.metadata, importlib.util
import shardwise
out["before"] = importlib.util.find_spec("deepspeed") is not None
shardwise.install_as_deepspeed()
shardwise.install_as_deepspeed()  # idempotent
out["finders"] = sum(type(f).__name__ == "_DeepSpeedAliasFinder" for f in sys.meta_path)
out["spec"] = importlib.util.find_spec("deepspeed") is not None
out["version"] = importlib.metadata.version("deepspeed")
out["name"] = importlib.metadata.metadata("deepspeed")["Name"]
import deepspeed
import deepspeed.zero
import deepspeed.runtime.zero.partition_parameters as pp
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed import comm as dist
out["same"] = [deepspeed is shardwise, sys.modules["deepspeed.zero"] is shardwise.zero,
               pp is sys.modules["shardwise.runtime.zero.partition_parameters"],
               DeepSpeedEngine is shardwise.Engine, dist is shardwise.comm,
               deepspeed.runtime.lr_schedules is sys.modules["shardwise.runtime.lr_schedules"]]
out["own_spec"] = shardwise.zero.__spec__.name
out["deepspeed_modules"] = sorted(n for n in sys.modules if n.startswith("deepspeed")
                                  and sys.modules[n] is not sys.modules["shardwise" + n[len("deepspeed"):]])
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
out["ulysses"] = UlyssesSPAttentionHF.__module__
try:
    import deepspeed.runtime.domino.transformer
except ModuleNotFoundError as error:
    out["missing"] = [error.name, str(error)]
from accelerate.utils import compare_versions, is_deepspeed_available
from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_available as hf_available
out["libraries"] = [is_deepspeed_available(), hf_available(), compare_versions("deepspeed", ">=", "0.16.4"),
                    HfDeepSpeedConfig.__mro__[1].__name__]
"""


def test_alias_resolves_to_shardwise_modules():
    out = _run(_ALIAS_CHECKS)
    assert out["before"] is False  # the real DeepSpeed is not installed here
    assert out["finders"] == 1 and out["spec"]
    assert out["version"].startswith("0.19.8+shardwise.") and out["name"] == "deepspeed"
    assert all(out["same"]), out["same"]
    assert out["own_spec"] == "shardwise.zero"  # the alias leaves the module's own spec in place
    assert out["deepspeed_modules"] == []  # no second module object under any deepspeed name
    assert out["ulysses"] == "shardwise.runtime.sequence_parallel.ulysses_sp"  # ALST at DeepSpeed's path
    assert out["missing"][0] == "deepspeed.runtime.domino"
    assert "shardwise.runtime.domino" in out["missing"][1]
    assert out["libraries"] == [True, True, True, "HfDeepSpeedConfig"]


def test_alias_wins_over_an_installed_deepspeed(tmp_path):
    fake = tmp_path / "deepspeed"
    (fake / "zero").mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    (fake / "zero" / "__init__.py").write_text("REAL = True\n")
    (fake / "only_real.py").write_text("REAL = True\n")
    out = _run(
        """
        import importlib.util
        out["real_first"] = importlib.util.find_spec("deepspeed").origin
        import shardwise
        shardwise.install_as_deepspeed()
        import deepspeed, deepspeed.zero
        out["same"] = [deepspeed is shardwise, deepspeed.zero is shardwise.zero]
        try:
            import deepspeed.only_real
        except ModuleNotFoundError as error:
            out["missing"] = error.name
    """,
        path=str(tmp_path),
    )
    assert out["real_first"].startswith(str(fake))
    assert out["same"] == [True, True]
    assert out["missing"] == "deepspeed.only_real"  # never picked up from the real package's folder


@pytest.mark.parametrize(
    "first", ["import accelerate.utils", "import transformers.trainer", "import transformers.integrations.deepspeed"]
)
def test_install_after_a_library_decided_is_an_error(first):
    out = _run(f"""
        {first}
        import shardwise
        try:
            shardwise.install_as_deepspeed()
        except RuntimeError as error:
            out["error"] = str(error)
        out["installed"] = any(type(f).__name__ == "_DeepSpeedAliasFinder" for f in sys.meta_path)
    """)
    assert first.split()[1] in out["error"] and "before importing accelerate" in out["error"]
    assert out["installed"] is False
