"""What a written checkpoint holds, for tests that check what a save left out."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open


def stored_tensor_names(directory: str | Path) -> list[str]:
    """Every tensor name the checkpoint folder ``directory`` holds: its manifest's module
    skeleton and the keys of its safetensors files."""
    directory = Path(directory)
    names = set(json.loads((directory / "manifest.json").read_text())["skeletons"]["module"])
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            names.update(handle.keys())
    return sorted(names)
