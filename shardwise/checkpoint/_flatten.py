"""Split a nested state (state_dicts, RNG states, client data) into tensors and JSON.

A checkpoint stores tensors in safetensors files and everything else as JSON in the
manifest, so no loader ever unpickles anything. ``flatten_state`` walks a nested
structure and returns the tensors keyed by their dotted path plus a *skeleton*: the same
structure with every tensor replaced by ``{"__tensor__": key}``. The skeleton is plain
JSON (lists, str-keyed dicts, str, int, float, bool, null), so it can be written with
``json.dump`` and read back before ``unflatten_state`` rebuilds the original.

[Note: skeleton encoding]
Values JSON cannot express are wrapped in a one-key dict whose key is a marker:

- ``{"__tensor__": "state.0.exp_avg"}``  a tensor, by its key in the tensor files
- ``{"__tuple__": [...]}``               a tuple (``random.getstate()`` needs tuples back)
- ``{"__dict__": [[key, value], ...]}``  a dict whose keys are not all str (optimizer
  ``state`` has int keys), or one that uses a marker as a key
- ``{"__float__": "nan" | "inf" | "-inf"}``  a non-finite float (strict JSON has none)
- ``{"__dtype__": "float32"}``, ``{"__size__": [2, 3]}``, ``{"__device__": "cuda:0"}``

Any other dict is stored as itself, so a state_dict's skeleton stays readable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from shardwise.checkpoint._format import CheckpointError

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_FLOAT = "__float__"
_DTYPE = "__dtype__"
_SIZE = "__size__"
_DEVICE = "__device__"
_MARKERS = frozenset({_TENSOR, _TUPLE, _DICT, _FLOAT, _DTYPE, _SIZE, _DEVICE})

_SUPPORTED = (
    "tensors and plain data (dict with str or int keys, list, tuple, str, int, float, "
    "bool, None, torch.dtype, torch.Size, torch.device)"
)


def flatten_state(obj: Any, *, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``obj`` into its tensors and a JSON-serialisable skeleton.

    Each tensor is detached and copied to a new contiguous CPU tensor, so the result
    shares no storage with ``obj`` (safetensors refuses shared storage) and later
    training steps cannot change what is saved. The copy costs host memory equal to
    the size of the tensors in ``obj``.

    Keys are the dotted path of the tensor inside ``obj`` (``"state.0.exp_avg"``,
    ``"layers.0.weight"``), prefixed by ``prefix``. Should two paths collide (a dict key
    containing a dot), the later one gets a ``#<n>`` suffix; the skeleton records the
    key actually used.

    Args:
        obj: The nested state, see [Note: skeleton encoding] for what may appear.
        prefix: Prepended (with a dot) to every tensor key, so that several states can
            share one safetensors file without clashing.

    Returns:
        ``(tensors, skeleton)``; ``unflatten_state(tensors, skeleton)`` rebuilds ``obj``
        with dicts as plain ``dict``.

    Raises:
        TypeError: ``obj`` holds a value that is not a tensor or plain data (the message
            names its path and type), a sparse or meta tensor, or a reference cycle.
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(obj, prefix, tensors, set())
    return tensors, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Any) -> Any:
    """Rebuild the state that ``flatten_state`` split into ``tensors`` and ``skeleton``.

    The tensors are placed into the structure as they are (not copied). Tensors in
    ``tensors`` that the skeleton does not reference are ignored.

    Raises:
        CheckpointError: the skeleton references a tensor key absent from ``tensors``,
            or the skeleton is malformed (a damaged manifest).
    """
    return _decode(skeleton, tensors, "")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _unsupported(path: str, what: str) -> TypeError:
    where = path or "<root>"
    return TypeError(
        f"cannot store {where!r} in a checkpoint: {what}; checkpoints only store "
        f"{_SUPPORTED}; convert the value (e.g. to a dict of tensors) first"
    )


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], active: set[int]) -> Any:
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {_FLOAT: "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, torch.Tensor):
        return {_TENSOR: _store_tensor(obj, path, tensors)}
    if isinstance(obj, torch.dtype):
        return {_DTYPE: str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {_DEVICE: str(obj)}
    if isinstance(obj, torch.Size):
        return {_SIZE: [int(d) for d in obj]}
    if isinstance(obj, (dict, list)) or type(obj) is tuple:
        return _encode_container(obj, path, tensors, active)
    if isinstance(obj, tuple):
        raise _unsupported(
            path,
            f"it is a {type(obj).__qualname__} (a tuple subclass such as a "
            "namedtuple cannot be rebuilt from plain data)",
        )
    raise _unsupported(path, f"it is a {type(obj).__module__}.{type(obj).__qualname__}")


def _encode_container(obj: Any, path: str, tensors: dict[str, torch.Tensor], active: set[int]) -> Any:
    if id(obj) in active:
        raise _unsupported(path, "it contains itself (a reference cycle)")
    active.add(id(obj))
    try:
        if isinstance(obj, dict):
            return _encode_dict(obj, path, tensors, active)
        items = [_encode(v, _join(path, i), tensors, active) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {_TUPLE: items}
    finally:
        active.discard(id(obj))


def _encode_dict(obj: dict, path: str, tensors: dict[str, torch.Tensor], active: set[int]) -> Any:
    for key in obj:
        if not isinstance(key, (str, int)):
            raise _unsupported(_join(path, repr(key)), f"its dict key has type {type(key).__qualname__}")
    plain = all(type(k) is str and k not in _MARKERS for k in obj)
    if plain:
        return {k: _encode(v, _join(path, k), tensors, active) for k, v in obj.items()}
    pairs = []
    for key, value in obj.items():
        stored_key = key if isinstance(key, bool) else (int(key) if isinstance(key, int) else str(key))
        pairs.append([stored_key, _encode(value, _join(path, key), tensors, active)])
    return {_DICT: pairs}


def _store_tensor(tensor: torch.Tensor, path: str, tensors: dict[str, torch.Tensor]) -> str:
    if tensor.layout != torch.strided:
        raise _unsupported(path, f"it is a {tensor.layout} tensor; convert it with .to_dense()")
    if tensor.is_meta:
        raise _unsupported(path, "it is a meta tensor (it holds no data); materialize it first")
    if tensor.is_quantized:
        raise _unsupported(path, "it is a quantized tensor; store its int_repr() and scales")
    key = path or "tensor"
    if key in tensors:
        suffix = 2
        while f"{key}#{suffix}" in tensors:
            suffix += 1
        key = f"{key}#{suffix}"
    source = tensor.detach()
    copy = torch.empty(source.shape, dtype=source.dtype, device="cpu")
    copy.copy_(source)
    tensors[key] = copy
    return key


def _decode(node: Any, tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, _join(path, i)) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        raise _malformed(path, f"unexpected {type(node).__qualname__}")
    if len(node) == 1:
        marker, value = next(iter(node.items()))
        if marker in _MARKERS:
            return _decode_marker(marker, value, tensors, path)
    return {k: _decode(v, tensors, _join(path, k)) for k, v in node.items()}


def _decode_marker(marker: str, value: Any, tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    if marker == _TENSOR:
        if value not in tensors:
            raise CheckpointError(
                f"the checkpoint structure references tensor {value!r} (at {path or '<root>'!r}) "
                "but the loaded tensor file does not contain it; the file belongs to another "
                "checkpoint or was replaced; load an earlier tag or re-save"
            )
        return tensors[value]
    if marker == _TUPLE and isinstance(value, list):
        return tuple(_decode(v, tensors, _join(path, i)) for i, v in enumerate(value))
    if marker == _DICT and isinstance(value, list):
        result = {}
        for pair in value:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))):
                raise _malformed(path, "bad dict entry")
            result[pair[0]] = _decode(pair[1], tensors, _join(path, pair[0]))
        return result
    if marker == _FLOAT and value in ("nan", "inf", "-inf"):
        return float(value)
    if marker == _DTYPE and isinstance(value, str):
        dtype = getattr(torch, value, None)
        if isinstance(dtype, torch.dtype):
            return dtype
        raise CheckpointError(
            f"the checkpoint stores dtype {value!r} (at {path!r}), which this "
            f"PyTorch {torch.__version__} does not have; upgrade PyTorch"
        )
    if marker == _SIZE and isinstance(value, list):
        return torch.Size(value)
    if marker == _DEVICE and isinstance(value, str):
        return torch.device(value)
    raise _malformed(path, f"bad {marker} entry")


def _malformed(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint structure is malformed at {path or '<root>'!r} ({what}); "
        "manifest.json was damaged or edited; load an earlier tag or re-save"
    )
