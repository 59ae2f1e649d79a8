"""``install_as_deepspeed()``: make ``import deepspeed`` give shardwise, for libraries
(Hugging Face ``Trainer``, Accelerate) that import DeepSpeed themselves.

[Note: one module object per name]
``deepspeed`` and every ``deepspeed.<name>`` resolve to the module object of
``shardwise`` / ``shardwise.<name>``: the alias finder hands importlib a loader that
returns the already imported shardwise module instead of executing a second copy, so
``sys.modules["deepspeed.zero"] is shardwise.zero`` and ``isinstance`` checks against
classes reached either way agree. importlib stamps the alias spec onto the module it
loads; the loader puts the module's own spec back, so ``shardwise.zero.__spec__`` keeps
naming ``shardwise.zero``. A ``deepspeed.<name>`` that shardwise lacks raises
``ModuleNotFoundError`` naming it, and is never searched for on the file system (where a
real DeepSpeed, or shardwise's own files under a second name, could be found).

[Note: the alias's distribution version]
Hugging Face checks ``importlib.metadata.version("deepspeed")`` against minimum DeepSpeed
versions (``deepspeed>=0.9.3``, ``>=0.14.4``, ...). The alias distribution reports
``DEEPSPEED_API_VERSION`` (the DeepSpeed release whose API and config schema shardwise
follows) with shardwise's version as a PEP 440 local label, e.g.
``0.19.8+shardwise.0.1.0``: version checks compare as against that DeepSpeed release,
and the label says what is really installed. ``deepspeed.__version__`` is the module
attribute ``shardwise.__version__`` (one module object), not this string.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import re
import sys

DEEPSPEED_API_VERSION = "0.19.8"
"""The DeepSpeed release whose API shardwise follows; see [Note: the alias's distribution version]."""

_ALIAS, _TARGET = "deepspeed", "shardwise"


def _target_name(fullname: str) -> str | None:
    """``shardwise[.rest]`` for ``deepspeed[.rest]``; None for any other name."""
    if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
        return _TARGET + fullname[len(_ALIAS) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.<name>`` as the module object ``shardwise.<name>``
    (see [Note: one module object per name])."""

    def __init__(self, target: str):
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._own_spec


class _AliasDistribution(importlib.metadata.Distribution):
    """Package metadata for ``deepspeed`` (see [Note: the alias's distribution version])."""

    def read_text(self, filename):
        from shardwise.version import __version__

        if filename in ("METADATA", "PKG-INFO"):
            return (
                f"Metadata-Version: 2.1\nName: {_ALIAS}\nVersion: {DEEPSPEED_API_VERSION}+shardwise.{__version__}\n"
                "Summary: shardwise, installed under DeepSpeed's name by shardwise.install_as_deepspeed()\n"
            )
        if filename == "top_level.txt":
            return _ALIAS + "\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / path


class _DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` modules and the ``deepspeed`` distribution as shardwise's."""

    def find_spec(self, fullname, path=None, target=None):
        name = _target_name(fullname)
        if name is None:
            return None
        try:
            found = sys.modules.get(name) or importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(
                f"No module named '{fullname}': shardwise, installed as deepspeed by "
                f"install_as_deepspeed(), has no module '{name}'",
                name=fullname,
            )
        own = found if isinstance(found, importlib.machinery.ModuleSpec) else found.__spec__
        is_package = own is not None and own.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(name), is_package=is_package)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        wanted = context.name
        if wanted is None or re.sub(r"[-_.]+", "-", wanted).lower() == _ALIAS:
            yield _AliasDistribution()


def _stale_imports() -> list[str]:
    """Modules that decided at import time that DeepSpeed is missing, or hold another DeepSpeed."""
    stale = []
    imported = sys.modules.get(_ALIAS)
    if imported is not None and imported is not sys.modules[_TARGET]:
        stale.append(f"deepspeed (another DeepSpeed, from {getattr(imported, '__file__', '?')})")
    accelerate_utils = sys.modules.get("accelerate.utils")
    if accelerate_utils is not None and not hasattr(accelerate_utils, "DeepSpeedEngineWrapper"):
        stale.append("accelerate.utils")
    hf_integration = sys.modules.get("transformers.integrations.deepspeed")
    if hf_integration is not None and getattr(hf_integration, "DeepSpeedConfig", None) is object:
        stale.append("transformers.integrations.deepspeed")
    trainer = sys.modules.get("transformers.trainer")
    if trainer is not None and not hasattr(trainer, "DeepSpeedSchedulerWrapper"):
        stale.append("transformers.trainer")
    return stale


def install_as_deepspeed() -> None:
    """Make ``import deepspeed`` (and ``deepspeed.<name>``) give shardwise's modules.

    Call it once at the top of the script, before importing ``accelerate`` or
    ``transformers``' ``Trainer``: both decide when they are imported whether DeepSpeed
    is installed. Afterwards ``importlib.util.find_spec("deepspeed")`` finds the alias,
    ``importlib.metadata.version("deepspeed")`` answers a DeepSpeed-compatible version
    (see [Note: the alias's distribution version]) and ``sys.modules["deepspeed.zero"] is
    shardwise.zero``, whether or not the real DeepSpeed is installed (the alias comes
    first). Calling it again does nothing.

    Raises:
        RuntimeError: ``accelerate.utils``, ``transformers.trainer`` or
            ``transformers.integrations.deepspeed`` were imported before and recorded that
            DeepSpeed is missing, or the real DeepSpeed is already imported; the message
            names them. Nothing is installed then.
    """
    if any(isinstance(finder, _DeepSpeedAliasFinder) for finder in sys.meta_path):
        return
    stale = _stale_imports()
    if stale:
        raise RuntimeError(
            f"install_as_deepspeed() came too late: {', '.join(stale)} was imported before it and "
            "has already decided which DeepSpeed to use. Call shardwise.install_as_deepspeed() at the "
            "top of the script, before importing accelerate or transformers' Trainer"
        )
    sys.meta_path.insert(0, _DeepSpeedAliasFinder())
