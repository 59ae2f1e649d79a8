"""DeepSpeed's communication logger: latency and bandwidth per op and message size.

Configured by the ``"comms_logger"`` config section (through
:func:`comms_logger_from_config`) or by ``deepspeed.comm.configure(...)``; read with
``deepspeed.comm.log_summary()``. Every collective of a :class:`Communicator` (so ZeRO's
buckets, pipeline sends and receives, the 1-bit compressed exchange) and every call of the
functional API is a candidate; which ones are timed is chosen as DeepSpeed chooses.

[Note: the comms logger]
Selection: nothing is timed unless ``enabled``. Then a call is timed when ``prof_all`` is
set (the default), when its log name is in ``prof_ops``, or when the functional call says
``prof=True``. The log name is the ``log_name`` argument of a functional call (its
default is the op's name) and the op's DeepSpeed name for the library's own collectives
(``all_reduce``, ``broadcast``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ``send``, ``recv``). Unlike DeepSpeed, ``prof_ops`` also matches a
default log name, so ``prof_ops: ["all_reduce"]`` selects every all-reduce. ``debug``
appends `` | [Caller Func: <name>]``, the first function outside ``shardwise.comm`` on
the stack.

Timing: from just before the collective starts until its wait completes; a collective
whose handle is never waited for is not logged, and an asynchronous functional call that
is timed is waited for before it returns (DeepSpeed synchronizes logged calls too). On
CPU this is wall-clock time. On CUDA a timing event is recorded on the current stream
before the collective and another after the current stream has been made to wait for
it; the thread then synchronizes on the second event and reads the elapsed time. That
synchronization happens only for timed calls, so with the logger off the stream-ordered
waits of [Note: stream-ordered waits] in ``_collectives.py`` are unchanged. A world of
one rank issues no collective and logs nothing.

Message size and bandwidth: the message size is the input's bytes, as in DeepSpeed
(all-reduce: the tensor; all-gather: one rank's input, i.e. the output / n;
reduce-scatter: the whole input; all-to-all: the input; broadcast, send, recv: the
tensor; barrier: 0). From it and the latency, with n the size of the op's group:
all-reduce ``tput = 2 S / t`` and ``busbw = S / t * 2 (n - 1) / n``; all-gather
``tput = n S / t``, ``busbw = tput (n - 1) / n``; reduce-scatter ``tput = S / t``,
``busbw = tput (n - 1) / n``; all-to-all ``tput = S / t``, ``busbw = tput (n - 1) / n``;
the rooted and point-to-point ops ``busbw = tput = S / t``; in Gbit/s. Two departures
from DeepSpeed: n is the op's group size (DeepSpeed uses the world size), and the
reduce-scatter's size is not multiplied by n a second time (DeepSpeed multiplies its
already-full input by n, which overstates its bandwidth n times; the values here are
nccl-tests' definitions).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime

import torch
import torch.distributed as dist

from shardwise.config._monitor import CommsLoggerConfig

logger = logging.getLogger(__name__)

_COMM_DIR = os.path.dirname(os.path.abspath(__file__))

_ALL_REDUCE = frozenset({"all_reduce", "all_reduce_coalesced", "inference_all_reduce"})
_ALL_GATHER = frozenset({"all_gather", "all_gather_into_tensor"})
_ONE_SHARD_EACH = frozenset({"reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single"})
_ROOTED = frozenset(
    {"broadcast", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "barrier", "monitored_barrier"}
)
_FIELDS = ("enabled", "prof_all", "prof_ops", "verbose", "debug")
"""The keys of the ``"comms_logger"`` section."""


def bandwidth_gbps(op: str, msg_size: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """``(tput, busbw)`` in Gbit/s of one ``op`` that moved ``msg_size`` bytes (the input's
    size: see [Note: the comms logger]) in ``latency_ms`` over ``world_size`` ranks.

    Raises ValueError for an op name it has no formula for."""
    n = world_size
    if op in _ALL_REDUCE:
        tput, bus_factor = 2 * msg_size, (n - 1) / n
    elif op in _ALL_GATHER:
        tput, bus_factor = n * msg_size, (n - 1) / n
    elif op in _ONE_SHARD_EACH:
        tput, bus_factor = msg_size, (n - 1) / n
    elif op in _ROOTED:
        tput, bus_factor = msg_size, 1.0
    else:
        raise ValueError(
            f"the comms logger has no bandwidth formula for op {op!r}; known ops: "
            f"{sorted(_ALL_REDUCE | _ALL_GATHER | _ONE_SHARD_EACH | _ROOTED)}"
        )
    if latency_ms <= 0:
        return 0.0, 0.0
    to_gbps = 8 / 1e6  # bytes per ms -> Gbit/s
    return tput / latency_ms * to_gbps, tput * bus_factor / latency_ms * to_gbps


def format_size(num_bytes: int) -> str:
    """``num_bytes`` in binary units with two decimals, as DeepSpeed prints it: ``3.91 KB``."""
    if num_bytes == 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    power = 0
    while power < len(units) - 1 and num_bytes >= 1024 ** (power + 1):  # exact, unlike a float log
        power += 1
    return f"{round(num_bytes / 1024**power, 2)} {units[power]}"


def trimmed_mean(values: list[float], trim: float = 0.1) -> float:
    """The mean of ``values`` without the ``trim`` fraction at each end (0 when empty)."""
    if not values:
        return 0.0
    cut = int(round(len(values) * trim))
    kept = sorted(values)[cut : len(values) - cut] or sorted(values)
    return sum(kept) / len(kept)


def _caller_name() -> str:
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _COMM_DIR:
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "<unknown>"


class OpTimer:
    """One timed collective; :meth:`stop` once its wait has completed (see [Note: the comms
    logger] for what is measured on CPU and on CUDA)."""

    __slots__ = ("_log", "op", "name", "msg_size", "world_size", "_stream", "_start")

    def __init__(self, log: CommsLogger, op: str, name: str, msg_size: int, world_size: int, device: torch.device):
        self._log, self.op, self.name, self.msg_size, self.world_size = log, op, name, msg_size, world_size
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if self._stream is None:
            self._start = _perf_ms()
        else:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(self._stream)

    def stop(self) -> None:
        """Record the latency: the collective has completed (CPU) or the current stream
        waits for it (CUDA; this synchronizes on that stream's event)."""
        if self._stream is None:
            latency_ms = _perf_ms() - self._start
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self._stream)
            end.synchronize()
            latency_ms = self._start.elapsed_time(end)
        self._log.append(self.op, self.name, latency_ms, self.msg_size, self.world_size)


def _perf_ms() -> float:
    return time.perf_counter() * 1e3


class CommsLogger:
    """Per-log-name, per-message-size records of timed collectives (see [Note: the comms
    logger]). One process-wide instance, :data:`comms_logger`, is what the collectives use."""

    def __init__(self):
        self.enabled = False
        """The one check every collective makes; False: nothing else runs."""
        self.config = CommsLoggerConfig()
        self._records: dict[str, dict[int, list[list[float]]]] = {}
        """log name -> message size -> [latencies ms, tputs, busbws], one entry per call."""

    def apply(self, config: CommsLoggerConfig) -> None:
        """Take ``config``'s settings; the records collected so far are kept."""
        self.config = config
        self.enabled = config.enabled

    def start(
        self, op: str, log_name: str, msg_size: int, world_size: int, device: torch.device, *, prof: bool = False
    ) -> OpTimer | None:
        """A timer for one collective about to start, or None when it is not selected."""
        cfg = self.config
        if not (prof or cfg.prof_all or log_name in cfg.prof_ops):
            return None
        if cfg.debug:
            log_name = f"{log_name} | [Caller Func: {_caller_name()}]"
        return OpTimer(self, op, log_name, msg_size, world_size, device)

    def append(self, op: str, log_name: str, latency_ms: float, msg_size: int, world_size: int) -> None:
        """Add one completed call of ``op`` under ``log_name``."""
        tput, busbw = bandwidth_gbps(op, msg_size, latency_ms, world_size)
        entry = self._records.setdefault(log_name, {}).setdefault(msg_size, [[], [], []])
        entry[0].append(latency_ms)
        entry[1].append(tput)
        entry[2].append(busbw)
        if self.config.verbose and _global_rank() == 0:
            logger.info(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                log_name,
                latency_ms,
                format_size(msg_size),
                tput,
                busbw,
            )

    @contextlib.contextmanager
    def paused(self):
        """Time nothing inside the block (the summary's own collectives)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def reset(self) -> None:
        """Forget every record."""
        self._records.clear()

    def op_names(self) -> list[str]:
        """The log names recorded so far, in first-seen order."""
        return list(self._records)

    def total_count(self) -> int:
        """The number of calls recorded, over all log names and sizes."""
        return sum(len(e[0]) for sizes in self._records.values() for e in sizes.values())

    def summary(self) -> dict[str, dict[int, dict]]:
        """log name -> message size -> count, total and trimmed-mean latency and bandwidths
        (DeepSpeed's ``log_summary(return_dict=True)["summary"]`` layout)."""
        out: dict[str, dict[int, dict]] = {}
        for name, sizes in list(self._records.items()):
            out[name] = {
                size: {
                    "count": len(lat),
                    "total_latency_ms": sum(lat),
                    "avg_latency_ms": trimmed_mean(lat),
                    "tput_avg_gbps": trimmed_mean(tput),
                    "busbw_avg_gbps": trimmed_mean(bus),
                    "msg_size_bytes": size,
                    "msg_size_str": format_size(size),
                }
                for size, (lat, tput, bus) in sorted(sizes.items())
            }
        return out

    def log_all(
        self, *, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False, comm=None, file=None
    ):
        """Print (to ``file``, default stdout) and/or return the summary; see
        :func:`shardwise.comm.log_summary`. ``comm``: the Communicator the straggler
        analysis reduces over (None: this rank's latencies only, straggler 0)."""
        summary = self.summary()
        stragglers = self._stragglers(comm) if show_straggler else None
        if print_log:
            print(_table(summary, stragglers), file=file or sys.stdout, flush=True)
        if not return_dict:
            return None
        return {
            "summary": summary,
            "straggler_analysis": stragglers,
            "metadata": {"world_size": _world_size(), "rank": _global_rank(), "timestamp": datetime.now().isoformat()},
        }

    def _stragglers(self, comm) -> dict[str, dict[int, dict]]:
        """Per log name and size: the latency of the fastest rank and how much longer this
        rank took, call by call. One all-gather of the (name, size, count) keys and one
        MIN all-reduce of the latencies; keys that not every rank recorded equally often
        cannot be paired call by call and are left out, with a warning."""
        keys = sorted(
            (name, size, len(entry[0])) for name, sizes in self._records.items() for size, entry in sizes.items()
        )
        if comm is not None and comm.world_size > 1:
            with self.paused():
                everyone = comm.all_gather_object(keys, tag="comms logger straggler keys")
                common = set.intersection(*(set(map(tuple, rank_keys)) for rank_keys in everyone))
                if len(common) < len(keys):
                    logger.warning(
                        "comms logger: straggler analysis leaves out %s, which the ranks "
                        "recorded a different number of times",
                        sorted({k[0] for k in keys if k not in common}),
                    )
                keys = [k for k in keys if k in common]
                own = [lat for name, size, _ in keys for lat in self._records[name][size][0]]
                mins = torch.tensor(own, dtype=torch.float64, device=comm._device())
                comm.all_reduce(mins, op=dist.ReduceOp.MIN, tag="comms logger straggler").wait()
                fastest = mins.cpu().tolist()
        else:
            fastest = [lat for name, size, _ in keys for lat in self._records[name][size][0]]
        out: dict[str, dict[int, dict]] = {}
        start = 0
        for name, size, count in keys:
            lat = self._records[name][size][0]
            low = fastest[start : start + count]
            start += count
            late = [mine - best for mine, best in zip(lat, low)]
            out.setdefault(name, {})[size] = {
                "count": count,
                "total_comm_lat_ms": sum(low),
                "total_straggler_ms": sum(late),
                "avg_comm_lat_ms": trimmed_mean(low),
                "avg_straggler_ms": trimmed_mean(late),
                "msg_size_bytes": size,
                "msg_size_str": format_size(size),
            }
        return out


_SUMMARY_COLUMNS = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "tput_avg (Gbps)",
    "busbw_avg (Gbps)",
)
_SUMMARY_FIELDS = ("total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps")
_STRAGGLER_COLUMNS = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total comm lat(ms)",
    "Total straggler(ms)",
    "Avg comm lat(ms)",
    "Avg straggler(ms)",
)
_STRAGGLER_FIELDS = ("total_comm_lat_ms", "total_straggler_ms", "avg_comm_lat_ms", "avg_straggler_ms")
_WIDTH = 20


def _rows(columns, fields_, table) -> list[str]:
    lines = ["".join(f"{c:<{_WIDTH}}" for c in columns).rstrip()]
    for name, sizes in table.items():
        lines.append(name)
        for row in sizes.values():
            cells = [row["msg_size_str"], row["count"], *(f"{row[f]:.2f}" for f in fields_)]
            lines.append((" " * _WIDTH + "".join(f"{c:<{_WIDTH}}" for c in cells)).rstrip())
    return lines


def _table(summary, stragglers) -> str:
    """DeepSpeed's summary layout: a header of 20-character columns, then per log name a
    line with the name and one indented row per message size (ascending); trailing
    blanks are dropped."""
    lines = _rows(_SUMMARY_COLUMNS, _SUMMARY_FIELDS, summary)
    if stragglers is not None:
        lines += ["_" * 31, "Breakdown with straggler effect", "-" * 31]
        lines += _rows(_STRAGGLER_COLUMNS, _STRAGGLER_FIELDS, stragglers)
    return "\n".join(lines)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


comms_logger = CommsLogger()
"""The process-wide logger every Communicator and functional call reports to."""


def comms_logger_from_config(section=None) -> CommsLoggerConfig:
    """Configure the process-wide comms logger from the ``"comms_logger"`` config section.

    Contract: the engine calls this once at ``initialize()``, before the first collective,
    with the section as a dict (the DeepSpeed JSON's) or as a typed config section (any
    object with the attributes ``enabled``, ``prof_all``, ``prof_ops``, ``verbose``,
    ``debug``, such as the config package's comms-logger config)::

        shardwise.comm.comms_logger_from_config(ds_config_dict.get("comms_logger"))
        shardwise.comm.comms_logger_from_config(train_config.monitor.comms_logger)

    None (no section) leaves the logger as it is (off unless ``configure`` turned it on),
    as DeepSpeed does. Records collected so far are kept. Unlike DeepSpeed, whose logger is
    on whenever the section exists, ``"enabled": false`` keeps it off.

    Args:
        section: None, a mapping with keys among those five (missing keys take DeepSpeed's
            defaults: ``prof_all`` true, the others false or empty), a typed section, or
            a :class:`CommsLoggerConfig`.

    Returns:
        The settings now in force.

    Raises:
        ValueError: an unknown key, a value of the wrong type, or a section of another kind, named.
    """
    if section is None:
        return comms_logger.config
    if isinstance(section, Mapping):
        unknown = sorted(set(section) - set(_FIELDS))
        if unknown:
            raise ValueError(f"comms_logger has unknown key(s) {unknown}; allowed: {sorted(_FIELDS)}")
        section = CommsLoggerConfig(**section)
    elif not isinstance(section, CommsLoggerConfig):
        missing = [name for name in _FIELDS if not hasattr(section, name)]
        if missing:
            raise ValueError(
                f"comms_logger must be a dict or a config with the fields {list(_FIELDS)}; "
                f"got a {type(section).__name__} without {missing}"
            )
        section = CommsLoggerConfig(**{name: getattr(section, name) for name in _FIELDS})
    comms_logger.apply(section)
    return section


# -- DeepSpeed's deepspeed.comm functions over the process-wide logger ---------------------


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """Set the comms logger as DeepSpeed's ``deepspeed.comm.configure`` does.

    ``deepspeed_config`` is applied first (when it has a ``"comms_logger"`` section), then
    each keyword that is not None overrides its setting; ``configure(enabled=True)`` alone
    times every collective (``prof_all`` defaults to true). Records collected so far are kept.

    Args:
        deepspeed_config: None, the DeepSpeed config dict, an object with a
            ``comms_logger`` attribute, or the section itself (see
            :func:`comms_logger_from_config`).
        enabled, prof_all, prof_ops, verbose, debug: see :class:`CommsLoggerConfig`.

    Raises:
        ValueError: a setting of the wrong type, or a ``deepspeed_config`` of another kind.
    """
    if isinstance(deepspeed_config, Mapping):
        comms_logger_from_config(deepspeed_config.get("comms_logger"))
    elif hasattr(deepspeed_config, "comms_logger"):
        comms_logger_from_config(deepspeed_config.comms_logger)
    else:
        comms_logger_from_config(deepspeed_config)
    overrides = {
        k: v
        for k, v in (
            ("enabled", enabled),
            ("prof_all", prof_all),
            ("prof_ops", prof_ops),
            ("verbose", verbose),
            ("debug", debug),
        )
        if v is not None
    }
    if overrides:
        comms_logger.apply(replace(comms_logger.config, **overrides))


def reset_log() -> None:
    """Forget every record (e.g. at the start of each epoch, for per-epoch summaries)."""
    comms_logger.reset()


def has_comm_data() -> bool:
    """Whether any collective has been logged since the start or the last ``reset_log``."""
    return comms_logger.total_count() > 0


def get_comm_operation_count() -> int:
    """The number of collectives logged, over all log names and message sizes."""
    return comms_logger.total_count()


def get_logged_comm_ops() -> list[str]:
    """The log names recorded so far, in first-seen order."""
    return comms_logger.op_names()
