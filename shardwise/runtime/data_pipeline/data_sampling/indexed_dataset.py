"""Memory-mapped index files (``<prefix>.bin`` + ``<prefix>.idx``), the format of Megatron's and
DeepSpeed's ``MMapIndexedDataset``, so the files either library writes load in the other.

[Note: the mmap index format]
``<prefix>.bin`` holds the rows back to back as raw little-endian values of one dtype.
``<prefix>.idx`` describes them, all integers little-endian:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version, always 1
    uint8     dtype code (see ``DTYPE_CODES``)
    uint64    number of rows N
    uint64    number of document boundaries D
    int32[N]  row lengths, in elements
    int64[N]  row start offsets in ``.bin``, in bytes (exclusive prefix sum of lengths * itemsize)
    int64[D]  document index: row number where each document starts, then the row count

The analyzer writes each metric as one document, so D is 2 for its files.
"""

from __future__ import annotations

import numbers
import os
import shutil
import struct

import numpy as np
import torch

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, tuple[type, torch.dtype | None]] = {
    1: (np.uint8, torch.uint8),
    2: (np.int8, torch.int8),
    3: (np.int16, torch.int16),
    4: (np.int32, torch.int32),
    5: (np.int64, torch.int64),
    6: (np.uint16, None),
    7: (np.uint32, None),
    8: (np.uint64, None),
}
"""The dtype codes DeepSpeed 0.19.8 writes (Megatron's table differs from code 6 on)."""

valid_dtypes = {np_dt for np_dt, _ in DTYPE_CODES.values()} | {t for _, t in DTYPE_CODES.values() if t is not None}

_ANALYZER_HINT = (
    "index files are written by the data analyzer: DataAnalyzer(dataset, metric_names=[...], "
    "metric_functions=[...], metric_types=[...], metric_dtypes=[...], save_path=...).run_map_reduce() "
    "from shardwise.runtime.data_pipeline.data_sampling.data_analyzer (or DeepSpeed's), which "
    "writes <save_path>/<metric>/<metric>_index_to_sample(.bin/.idx) and the other index files"
)


def index_file_path(prefix_path: str) -> str:
    """The ``.idx`` file of an index prefix."""
    return f"{prefix_path}.idx"


def data_file_path(prefix_path: str) -> str:
    """The ``.bin`` file of an index prefix."""
    return f"{prefix_path}.bin"


def dtype_code(dtype) -> int:
    """The format's code for a numpy or torch dtype; ValueError for one it cannot store."""
    for code, (np_dt, torch_dt) in DTYPE_CODES.items():
        if dtype == np_dt or (torch_dt is not None and dtype == torch_dt):
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in an index file; supported: {sorted(map(str, valid_dtypes))}")


def _numpy_dtype(dtype) -> np.dtype:
    return np.dtype(DTYPE_CODES[dtype_code(dtype)][0])


def _damaged(path: str, why: str) -> ValueError:
    return ValueError(f"index file {path} is damaged or not an mmap index file ({why}); rebuild it: {_ANALYZER_HINT}")


class _Index:
    """The parsed ``.idx`` file: dtype, row sizes, row byte offsets and the document index."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as stream:
            head = stream.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise _damaged(path, f"{len(head)} bytes, shorter than the {_HEADER.size}-byte header")
        magic, version, code, num_rows, num_docs = _HEADER.unpack(head)
        if magic != _MAGIC:
            raise _damaged(path, f"magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise _damaged(path, f"version {version}, expected {_VERSION}")
        if code not in DTYPE_CODES:
            raise _damaged(path, f"unknown dtype code {code}")
        expected = _HEADER.size + 4 * num_rows + 8 * num_rows + 8 * num_docs
        actual = os.path.getsize(path)
        if actual != expected:
            raise _damaged(path, f"{actual} bytes, the header promises {expected}")
        self.dtype = np.dtype(DTYPE_CODES[code][0])
        buffer = np.memmap(path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(buffer, dtype="<i4", count=num_rows, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(buffer, dtype="<i8", count=num_rows, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(buffer, dtype="<i8", count=num_docs, offset=offset)


class MMapIndexedDataset(torch.utils.data.Dataset):
    """Rows of integers read lazily from ``<path>.bin`` through ``<path>.idx``.

    ``ds[i]`` is row ``i`` as a read-only numpy array (a view of the mapped file);
    ``ds[a:b]`` a list of rows (contiguous slices only). Pickles as its path, so it can go
    to DataLoader workers. See [Note: the mmap index format].

    Args:
        path: the prefix, without ``.bin`` / ``.idx``.
        skip_warmup: accepted for DeepSpeed's signature; pages are always read on demand.

    Raises:
        FileNotFoundError: a file is missing (names it and the analyzer call that writes it).
        ValueError: the files are damaged or do not belong together.
    """

    def __init__(self, path: str, skip_warmup: bool = False) -> None:
        super().__init__()
        self._open(str(path))

    def _open(self, path: str) -> None:
        for name in (index_file_path(path), data_file_path(path)):
            if not os.path.isfile(name):
                raise FileNotFoundError(f"index file {name} does not exist; {_ANALYZER_HINT}")
        self._path = path
        self._index = _Index(index_file_path(path))
        data_bytes = os.path.getsize(data_file_path(path))
        needed = int(self._index.sizes.astype(np.int64).sum()) * self._index.dtype.itemsize
        if data_bytes != needed:
            raise _damaged(data_file_path(path), f"{data_bytes} bytes, the index describes {needed}")
        # np.memmap refuses empty files; an index of empty rows needs no data
        self._data = np.memmap(data_file_path(path), mode="r", dtype=np.uint8) if data_bytes else np.empty(0, np.uint8)

    def __getstate__(self) -> str:
        return self._path

    def __setstate__(self, state: str) -> None:
        self._open(state)

    def __len__(self) -> int:
        return len(self._index.sizes)

    def __getitem__(self, idx):
        if isinstance(idx, numbers.Integral):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of {self._path} must be contiguous, got step {step}")
            if start >= stop:
                return []
            flat = self._read(int(self._index.pointers[start]), int(self._index.sizes[start:stop].sum()))
            return np.split(flat, np.cumsum(self._index.sizes[start : stop - 1]))
        raise TypeError(f"index {self._path} by int or slice, got {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Row ``idx`` (negative counts from the end), or ``length`` elements of it from ``offset``."""
        num_rows = len(self)
        if not -num_rows <= idx < num_rows:
            raise IndexError(f"row {idx} out of range for {self._path} with {num_rows} rows")
        idx = int(idx) % num_rows
        size = int(self._index.sizes[idx])
        length = size - offset if length is None else length
        start = int(self._index.pointers[idx]) + offset * self._index.dtype.itemsize
        return self._read(start, length)

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self._data, dtype=self._index.dtype, count=count, offset=byte_offset)

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    def size(self, index: int) -> int:
        return int(self._index.sizes[index])

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.isfile(index_file_path(path)) and os.path.isfile(data_file_path(path))


class MMapIndexedDatasetBuilder:
    """Appends rows to ``out_file`` (a ``.bin``) and writes the matching ``.idx`` at ``finalize``.

    Args:
        out_file: the ``.bin`` path to create (truncated if it exists).
        dtype: the stored dtype, numpy or torch (one of ``valid_dtypes``); rows are cast to it.
    """

    def __init__(self, out_file: str, dtype=np.int64) -> None:
        self._dtype = _numpy_dtype(dtype)
        self._data_file = open(out_file, "wb")  # noqa: SIM115 - open until finalize()
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tensor: torch.Tensor) -> None:
        """Append one row from a CPU tensor."""
        self.add_item_numpy(tensor.numpy())

    def add_items(self, arrays) -> None:
        """Append one row per numpy array."""
        for array in arrays:
            self.add_item_numpy(array)

    def add_item_numpy(self, array: np.ndarray) -> None:
        """Append one row (flattened, cast to the builder's dtype)."""
        row = np.ascontiguousarray(array, dtype=self._dtype.newbyteorder("<")).reshape(-1)
        self._data_file.write(row.tobytes())
        self._sizes.append(row.size)

    def end_document(self) -> None:
        """Close the current document: the next row starts a new one."""
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_prefix: str) -> None:
        """Append every row and document of the index at ``another_prefix`` (same dtype)."""
        other = _Index(index_file_path(another_prefix))
        if other.dtype != self._dtype:
            raise ValueError(f"cannot merge {another_prefix} ({other.dtype}) into a {self._dtype} index")
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in other.sizes)
        self._doc_idx.extend(offset + int(d) for d in other.doc_idx[1:])
        with open(data_file_path(another_prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file)

    def finalize(self, index_file: str) -> None:
        """Close the ``.bin`` and write ``index_file`` (the ``.idx``)."""
        self._data_file.close()
        sizes = np.asarray(self._sizes, dtype="<i4")
        pointers = np.zeros(len(sizes), dtype="<i8")
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype("<i8") * self._dtype.itemsize, out=pointers[1:])
        header = _HEADER.pack(_MAGIC, _VERSION, dtype_code(self._dtype), len(sizes), len(self._doc_idx))
        with open(index_file, "wb") as out:
            out.write(header)
            out.write(sizes.tobytes())
            out.write(pointers.tobytes())
            out.write(np.asarray(self._doc_idx, dtype="<i8").tobytes())
