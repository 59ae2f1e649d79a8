"""Which environment variables reach every rank, including ranks on other machines."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

NO_LOCAL_RANK_ENV = "SHARDWISE_NO_LOCAL_RANK"
"""Set to 1 to keep --local_rank=N off the script's command line."""
ENV_FILES = (".shardwise_env", ".deepspeed_env")
"""Files of KEY=VALUE lines, looked up in the working directory, then the home directory."""
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "FI_", "CUDA_", "TORCH_", "OMP_", "SHARDWISE_", "MKL_")
"""Variables with these prefixes are passed on to remote ranks."""

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def read_env_file(path: Path) -> dict[str, str]:
    """Parse KEY=VALUE lines (``#`` comments and blank lines allowed)."""
    values = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip().removeprefix("export ").strip()
        if not sep or not _KEY.match(key):
            raise ValueError(f"{path} line {number}: expected KEY=VALUE, got {raw.strip()!r}")
        values[key] = value.strip().strip('"').strip("'")
    return values


def env_file_values(*, cwd: Path | None = None, home: Path | None = None) -> dict[str, str]:
    """Values from the first env file found (working directory before home)."""
    for folder in (cwd or Path.cwd(), home or Path.home()):
        for name in ENV_FILES:
            path = folder / name
            if path.is_file():
                return read_env_file(path)
    return {}


def exports(
    environ: dict[str, str] | None = None, *, cwd: Path | None = None, home: Path | None = None
) -> dict[str, str]:
    """The variables to set on every remote rank."""
    environ = dict(os.environ if environ is None else environ)
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    out.update(env_file_values(cwd=cwd, home=home))
    return out


def export_prefix(values: dict[str, str]) -> str:
    """A shell snippet that exports ``values`` (safely quoted)."""
    return "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(values.items()))
