"""The search space as plain data: which configurations an autotuning run may try, and the
config file each one becomes. Pure functions; nothing here starts a process.

[Note: autotuning space]
A candidate is a ZeRO stage, a micro-batch size, the gradient accumulation that goes with
it, and whether the optimizer state (stage >= 1) and the parameters (stage 3) are offloaded.

- Stages: the user config's ``zero_optimization.stage`` as a number (only that one), a list,
  or ``"all"``; absent: all four (DeepSpeed's tuner then tries stage 0 only).
- Micro-batch sizes: ``train_micro_batch_size_per_gpu`` as a number (fixed), a list (those),
  or ``"auto"``/absent: the powers of two between the ``min_``/``max_train_micro_batch_size_
  per_gpu`` bounds (both bounds included), cut to ``num_tuning_micro_batch_sizes`` values
  spread evenly from the smallest to the largest.
- Global batch: a ``train_batch_size`` the user fixed stays fixed (accumulation = global /
  (micro x data-parallel ranks); a micro-batch that does not divide it is left out);
  otherwise accumulation is the user's ``gradient_accumulation_steps`` (default 1) and the
  global batch follows. Either way it must lie within ``min_``/``max_train_batch_size``.
- Offload: ``fast`` keeps the user's offload settings; otherwise each stage >= 1 is tried
  without and with optimizer offload, and stage 3 also with parameter offload.
- Tensor and pipeline degrees (beyond DeepSpeed's tuner): ``tensor_parallel.autotp_size``
  and ``pipeline.stages`` as a number are kept; as a list, each value whose product with
  ``mp_size`` and the other degree divides the world size is tried; ``autotp_size: "auto"``
  tries every such divisor. ``pipeline.stages: "auto"`` keeps DeepSpeed's meaning (the
  script's ``PipelineModule`` decides) and is not searched: the script must build its
  pipeline from the experiment's ``pipeline.stages`` (read from the config, or passed to
  a flag with ``arg_mappings``), so the tuner searches it only when asked with a list.
Data-parallel ranks are the world size divided by ``mp_size x tp x pp``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from shardwise.config._autotuning import AutotuningConfig
from shardwise.config._errors import ConfigError


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration the tuner may run (see [Note: autotuning space])."""

    stage: int
    micro_batch: int
    gas: int
    offload_optimizer: bool = False
    offload_param: bool = False
    tp: int = 1
    """Tensor-parallel degree (``tensor_parallel.autotp_size``)."""
    pp: int = 1
    """Pipeline degree (``pipeline.stages``)."""

    @property
    def name(self) -> str:
        """DeepSpeed's experiment name (``z1_gas2_tmbspg4``), with the offload and the
        tensor/pipeline degrees above 1 marked (``_offopt``, ``_offparam``, ``_tp2``, ``_pp2``)."""
        name = f"z{self.stage}_gas{self.gas}_tmbspg{self.micro_batch}"
        name += ("_offopt" if self.offload_optimizer else "") + ("_offparam" if self.offload_param else "")
        return name + (f"_tp{self.tp}" if self.tp > 1 else "") + (f"_pp{self.pp}" if self.pp > 1 else "")


def _stages(user: dict) -> list[int]:
    stage = (user.get("zero_optimization") or {}).get("stage", "all")
    values = [0, 1, 2, 3] if stage == "all" else stage if isinstance(stage, list) else [stage]
    for value in values:
        if value not in (0, 1, 2, 3) or isinstance(value, bool):
            raise ConfigError(f'zero_optimization.stage must be 0-3, a list of them or "all" to tune, got {stage!r}')
    return sorted(set(values))


def micro_batch_sizes(user: dict, tuning: AutotuningConfig) -> list[int]:
    """The micro-batch sizes to try (see [Note: autotuning space])."""
    given = user.get("train_micro_batch_size_per_gpu", "auto")
    if given != "auto":
        values = given if isinstance(given, list) else [given]
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ConfigError(f"train_micro_batch_size_per_gpu must be a positive integer (or a list, got {given!r}")
        return sorted(set(values))
    low, high = tuning.min_train_micro_batch_size_per_gpu, tuning.max_train_micro_batch_size_per_gpu
    ladder = sorted({low, high} | {2**k for k in range(high.bit_length()) if low <= 2**k <= high})
    count = tuning.num_tuning_micro_batch_sizes
    if len(ladder) <= count:
        return ladder
    if count == 1:
        return [ladder[-1]]
    return sorted({ladder[round(i * (len(ladder) - 1) / (count - 1))] for i in range(count)})


def _fixed_int(user: dict, key: str) -> int | None:
    value = user.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _gas_for(user: dict, micro: int, dp: int) -> int | None:
    total = _fixed_int(user, "train_batch_size")
    if total is None:
        return _fixed_int(user, "gradient_accumulation_steps") or 1
    if total % (micro * dp):
        return None
    return total // (micro * dp)


def _offloads(user: dict, stage: int, fast: bool) -> list[tuple[bool, bool]]:
    if fast:
        zero = user.get("zero_optimization") or {}
        opt = _offloaded(zero.get("offload_optimizer")) and stage >= 1
        return [(opt, _offloaded(zero.get("offload_param")) and stage == 3)]
    options = [(False, False)]
    if stage >= 1:
        options.append((True, False))
    if stage == 3:
        options.append((True, True))
    return options


def _offloaded(section) -> bool:
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)


def _degree_values(section_name: str, key: str, value, ranks: int) -> list[int]:
    if value == "auto":
        return [d for d in range(1, ranks + 1) if ranks % d == 0]
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= (key == "stages") for v in values):
        extra = ' or "auto"' if key == "autotp_size" else ""
        raise ConfigError(
            f"{section_name}.{key} must be a positive integer (or a list of them to tune){extra}, got {value!r}"
        )
    return sorted({max(v, 1) for v in values})  # autotp_size 0 means no tensor parallelism


def parallel_degrees(user: dict, world_size: int, mp_size: int) -> list[tuple[int, int]]:
    """The (tp, pp) pairs to try whose product with ``mp_size`` divides ``world_size``
    (see [Note: autotuning space]).

    Raises:
        ConfigError: a degree the tuner cannot read, or none that divides the world (named).
    """
    ranks = world_size // mp_size
    tp_value = (user.get("tensor_parallel") or {}).get("autotp_size", 1)
    pp_value = (user.get("pipeline") or {}).get("stages", 1)
    tps = _degree_values("tensor_parallel", "autotp_size", tp_value, ranks)
    pps = [1] if pp_value == "auto" else _degree_values("pipeline", "stages", pp_value, ranks)
    pairs = [(tp, pp) for tp in tps for pp in pps if ranks % (tp * pp) == 0]
    if not pairs:
        raise ConfigError(
            f"autotuning: no tensor_parallel.autotp_size in {tps} and pipeline.stages in {pps} divides the "
            f"{world_size} rank(s) (with autotuning.mp_size={mp_size}); give degrees that divide it"
        )
    return pairs


def build_space(user: dict, tuning: AutotuningConfig, *, world_size: int) -> list[Candidate]:
    """Every candidate of the user config ``user`` (a DeepSpeed-style dict) on
    ``world_size`` ranks, in (stage, micro-batch) order (see [Note: autotuning space]).

    Raises:
        ConfigError: a stage, micro-batch or parallel degree the tuner cannot read, a world
            size that ``mp_size`` does not divide, or bounds that leave no candidate (named).
    """
    if world_size % tuning.mp_size:
        raise ConfigError(f"autotuning.mp_size={tuning.mp_size} does not divide the {world_size} rank(s)")
    degrees = parallel_degrees(user, world_size, tuning.mp_size)
    space = []
    for stage in _stages(user):
        for micro in micro_batch_sizes(user, tuning):
            for tp, pp in degrees:
                dp = world_size // (tuning.mp_size * tp * pp)
                gas = _gas_for(user, micro, dp)
                if gas is None:
                    continue
                total = micro * gas * dp
                if total < tuning.min_train_batch_size or (
                    tuning.max_train_batch_size is not None and total > tuning.max_train_batch_size
                ):
                    continue
                for opt, param in _offloads(user, stage, tuning.fast):
                    space.append(Candidate(stage, micro, gas, opt, param, tp, pp))
    if not space:
        raise ConfigError(
            "autotuning: no configuration satisfies the batch bounds: train_batch_size="
            f"{user.get('train_batch_size')!r}, micro-batch sizes {micro_batch_sizes(user, tuning)}, "
            f"{world_size // tuning.mp_size} data-parallel rank(s) at most, train_batch_size bounds "
            f"[{tuning.min_train_batch_size}, {tuning.max_train_batch_size}]"
        )
    return space


def data_parallel(candidate: Candidate, *, world_size: int, mp_size: int) -> int:
    """The data-parallel ranks of ``candidate`` on ``world_size`` ranks."""
    return world_size // (mp_size * candidate.tp * candidate.pp)


def experiment_config(user: dict, candidate: Candidate, *, dp: int, metric_path: str) -> dict:
    """The config file of ``candidate``: the user's config with the stage, batch sizes and
    offload replaced (all three batch keys written, for ``dp`` data-parallel ranks), and the
    autotuning section pointing the engine at ``metric_path``."""
    config = copy.deepcopy(user)
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = candidate.stage
    for key, wanted in (("offload_optimizer", candidate.offload_optimizer), ("offload_param", candidate.offload_param)):
        if not wanted:
            zero.pop(key, None)
        elif not _offloaded(zero.get(key)):
            zero[key] = {"device": "cpu"}
    config["zero_optimization"] = zero
    if candidate.tp > 1 or "tensor_parallel" in config:
        config["tensor_parallel"] = {**(config.get("tensor_parallel") or {}), "autotp_size": candidate.tp}
    if candidate.pp > 1 or (config.get("pipeline") or {}).get("stages", "auto") != "auto":
        config["pipeline"] = {**(config.get("pipeline") or {}), "stages": candidate.pp}
    config["train_micro_batch_size_per_gpu"] = candidate.micro_batch
    config["gradient_accumulation_steps"] = candidate.gas
    config["train_batch_size"] = candidate.micro_batch * candidate.gas * dp
    tuning = {k: v for k, v in (config.get("autotuning") or {}).items() if k not in ("results_dir", "exps_dir")}
    config["autotuning"] = {**tuning, "enabled": True, "metric_path": metric_path}
    return config


def optimal_config(experiment: dict) -> dict:
    """The config to train with after tuning: the experiment's, without its ``autotuning``
    section (as DeepSpeed writes ``ds_config_optimal.json``)."""
    return {k: v for k, v in experiment.items() if k != "autotuning"}
