"""``RandomLTD``: the one object an engine holds for random-LTD.

Contract for the engine (DeepSpeed's places, ``engine.py`` 0.19.8):
- build once, after the model's layers are converted: ``RandomLTD.from_config(section,
  model, global_batch_size=train_batch_size)``;
- before each training forward call ``before_forward(global_steps)`` (the count of
  optimizer steps taken so far); calls repeated within one step, for gradient accumulation,
  move nothing and count the step's layer tokens once. ``after_model_step(global_steps)``
  with the count after the step is the same update done early, for engines that hook there;
- save ``state_dict()`` under the checkpoint's ``random_ltd`` key and give it back to
  ``load_state_dict`` on resume; save model weights through ``remove_random_ltd_state_dict``.

It is also a training feature of the engine's extension point (``name``,
``keyword_help``, ``forward_kwargs``, ``before_model_step``, ``after_optimizer_step``,
``state_dict``, ``load_state_dict``): ``forward_kwargs(global_steps)``, called before each
training forward, is ``before_forward`` and passes no keywords; ``before_model_step`` and
``after_optimizer_step`` do nothing.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.config._errors import ConfigError
from shardwise.runtime.data_pipeline.data_routing._config import PATH, RandomLTDConfig, parse_random_ltd
from shardwise.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from shardwise.runtime.data_pipeline.data_routing.helper import _inner
from shardwise.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler


class RandomLTD:
    """The scheduler plus ``layers``, the converted layers that drop tokens (in
    ``random_ltd_layer_id`` order), whose kept length it sets (see the module docstring)."""

    name = "random_ltd"
    """Its key in checkpoints (DeepSpeed's)."""
    keyword_help: dict[str, str] = {}
    """It passes no keywords to the model's forward."""

    def __init__(self, scheduler: RandomLTDScheduler, layers: list[RandomLayerTokenDrop]):
        self.scheduler = scheduler
        self.layers = layers

    @classmethod
    def from_config(
        cls, section: Any, model, *, global_batch_size: int | None = None, token_kwargs: tuple[str, ...] = ()
    ) -> RandomLTD:
        """Turn on the section's layers among ``model``'s converted ones.

        ``section``: the ``random_ltd`` dict or a ``RandomLTDConfig`` (enabled).
        ``random_ltd_layer_id`` counts ``RandomLayerTokenDrop`` modules in module order
        (DeepSpeed matches the id inside the module name instead). Converted layers not
        listed keep every token. ``token_kwargs``: keyword arguments of the layers that hold
        per-token tensors to gather with the hidden states (a Llama layer's
        ``("position_embeddings", "position_ids")``). The schedule starts at step 0 (``before_forward(0)``
        again is a no-op; ``load_state_dict`` replaces it on resume). Raises ConfigError if
        the model has no converted layers or fewer than the largest id needs.
        """
        config = section if isinstance(section, RandomLTDConfig) else parse_random_ltd(section)
        if not config.enabled:
            raise ConfigError(f"{PATH}.enabled is false: nothing for RandomLTD to drive")
        wrapped = random_ltd_layers(model)
        if not wrapped:
            raise ConfigError(
                f"{PATH} is enabled but the model has no RandomLayerTokenDrop layers: call "
                f"convert_to_random_ltd(model, <your transformer block class>) first"
            )
        needed = max(config.random_ltd_layer_id)
        if needed >= len(wrapped):
            raise ConfigError(
                f"{PATH}.random_ltd_layer_id names layer {needed} but the model has {len(wrapped)} converted layers"
            )
        layers = [wrapped[i] for i in config.random_ltd_layer_id]
        for layer in layers:
            _configure(layer, config)
            layer.token_kwargs = tuple(token_kwargs)
        ltd = cls(RandomLTDScheduler(config, global_batch_size=global_batch_size), layers)
        ltd.before_forward(0)
        return ltd

    @property
    def consumed_layer_tokens(self) -> int:
        """Layer tokens consumed so far (the quantity DeepSpeed's layer-token lr schedule reads)."""
        return self.scheduler.consumed_layer_tokens

    def before_forward(self, global_steps: int) -> None:
        """Advance the schedule to ``global_steps`` and give the layers its kept length."""
        self.scheduler.update_seq(global_steps)
        self._push()

    def after_model_step(self, global_steps: int) -> None:
        """Same as ``before_forward(global_steps)`` with the step count after the step."""
        self.before_forward(global_steps)

    def forward_kwargs(self, global_steps: int) -> dict:
        """``before_forward(global_steps)``; no keywords for the forward."""
        self.before_forward(global_steps)
        return {}

    def before_model_step(self, global_steps: int) -> None:
        """Nothing: the kept length moves before the forward, as in DeepSpeed."""

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None:
        """Nothing (a training feature's hook; the engine's count has not moved yet)."""
        del global_steps, clip_coef

    def state_dict(self) -> dict[str, int]:
        """The scheduler's state under DeepSpeed's keys (the checkpoint's ``random_ltd``)."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume the schedule where ``state_dict`` left it."""
        self.scheduler.load_state_dict(state_dict)
        self._push()

    def _push(self) -> None:
        kept = self.scheduler.get_current_seq()
        for layer in self.layers:
            layer.kept_length = kept


def _configure(layer: RandomLayerTokenDrop, config: RandomLTDConfig) -> None:
    """Set the section's mask keyword and hidden-state order on one wrapper."""
    layer.mask_name = config.model_mask_name
    layer.batch_first = config.hidden_state_order == "batch_seq_dim"


def random_ltd_layers(model: nn.Module) -> list[RandomLayerTokenDrop]:
    """The converted layers of ``model`` (or an engine's ``.module``), in module order."""
    return [m for m in _inner(model).modules() if isinstance(m, RandomLayerTokenDrop)]
