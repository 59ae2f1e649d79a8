"""Layer reduction (XTC's first step): a shallower student starts from chosen teacher
layers. The student is then trained, typically with knowledge distillation from the
teacher, by the user's training loop."""

from __future__ import annotations

from torch import nn

from shardwise.config._compression import LayerReductionConfig
from shardwise.utils._modules import recursive_getattr


def _layers(model: nn.Module, prefix: str, who: str) -> nn.Module:
    try:
        layers = recursive_getattr(model, prefix)
    except AttributeError:
        raise ValueError(f"layer_reduction.module_name_prefix {prefix!r}: the {who} has no such module") from None
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ValueError(
            f"layer_reduction.module_name_prefix {prefix!r} names a {type(layers).__name__} in the {who}, "
            "not a ModuleList or Sequential of layers"
        )
    return layers


def _copy(target: nn.Module, source: nn.Module, what: str) -> None:
    try:
        target.load_state_dict(source.state_dict())
    except RuntimeError as error:
        raise ValueError(f"layer_reduction: the student's and the teacher's {what} differ: {error}") from None


def copy_teacher_layers(student: nn.Module, teacher: nn.Module, config: LayerReductionConfig) -> None:
    """Copy teacher layer ``config.teacher_layer[i]`` into student layer ``i``, and each
    ``config.other_module_name`` module whole (parameters and buffers).

    Raises:
        ValueError: a teacher layer the teacher does not have, more layers than the student
            has, a missing module, or shapes that differ.
    """
    teacher_layers = _layers(teacher, config.module_name_prefix, "teacher")
    student_layers = _layers(student, config.module_name_prefix, "student")
    for index in config.teacher_layer:
        if index >= len(teacher_layers):
            raise ValueError(
                f"layer_reduction.teacher_layer asks for layer {index}, but the teacher has "
                f"{len(teacher_layers)} layers (0 to {len(teacher_layers) - 1})"
            )
    if len(config.teacher_layer) > len(student_layers):
        raise ValueError(
            f"layer_reduction.teacher_layer names {len(config.teacher_layer)} layers, but the student "
            f"has {len(student_layers)}"
        )
    for position, index in enumerate(config.teacher_layer):
        _copy(student_layers[position], teacher_layers[index], f"layer {position} (teacher layer {index})")
    for name in config.other_module_name:
        try:
            source, target = recursive_getattr(teacher, name), recursive_getattr(student, name)
        except AttributeError:
            raise ValueError(f"layer_reduction.other_module_name {name!r}: no such module") from None
        _copy(target, source, f"module {name!r}")
