"""The legacy ``curriculum_learning`` and ``progressive_layer_drop`` sections in a world of
one: config errors, what the engine passes to the forward (and when not), the DeepSpeed
engine methods, a model that cannot take the keywords, and the helpers for models."""

import collections
import math

import pytest
import torch
from torch import nn

import shardwise
from shardwise.config import ConfigError, load_config
from shardwise.runtime.data_pipeline import (
    CurriculumTruncation,
    drop_layer,
    layer_keep_probability,
    truncate_to_curriculum,
)
from shardwise.runtime.progressive_layer_drop import ProgressiveLayerDrop
from shardwise.testing.models import TinyMLP

CURRICULUM = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 2,
    "max_difficulty": 8,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 2},
}


def _config(**sections):
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **sections}


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        ({"curriculum_learning": {**CURRICULUM, "max_difficulty": "long"}}, r"max_difficulty must be a number"),
        ({"curriculum_learning": {"enabled": True, "schedule_type": "fixed_linear"}}, r"needs 'min_difficulty'"),
        ({"curriculum_learning": {**CURRICULUM, "curriculum_type": "vocab"}}, r"curriculum_type must be one of seqlen"),
        ({"curriculum_learning": {**CURRICULUM, "min_dificulty": 2}}, r"did you mean 'curriculum_learning.min_diff"),
        ({"curriculum_learning": {**CURRICULUM, "min_difficulty": 16}}, r"min_difficulty=16 is above"),
        ({"progressive_layer_drop": {"enabled": True, "theta": 1.5}}, r"theta is a keep probability"),
        ({"progressive_layer_drop": {"enabled": True, "gamma": -1}}, r"gamma must be >= 0"),
        ({"progressive_layer_drop": {"enabled": True, "thetta": 0.5}}, r"did you mean 'progressive_layer_drop.theta'"),
        (
            {"data_efficiency": {"data_routing": {"random_ltd": {"enabled": True}}}},
            r"data_efficiency.data_routing.random_ltd.total_layer_num is required when random-LTD is enabled",
        ),
    ],
)
def test_config_errors_name_the_key(sections, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_config(**sections), world_size=1)


def test_defaults_and_disabled_sections():
    config = load_config(
        _config(curriculum_learning={"enabled": False, "min_difficulty": 8}, progressive_layer_drop={"enabled": True}),
        world_size=1,
    )
    assert not config.curriculum_learning.enabled
    assert (config.progressive_layer_drop.theta, config.progressive_layer_drop.gamma) == (1.0, 0.001)


class _Recording(TinyMLP):
    """TinyMLP that takes both features' keywords and records what each forward got."""

    def __init__(self):
        super().__init__(seed=1)
        self.seen = []

    def forward(self, tokens, targets, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=None):
        self.seen.append((curriculum_seqlen, progressive_layer_drop, pld_theta))
        return super().forward(*truncate_to_curriculum((tokens, targets), curriculum_seqlen))


def _engine(model, **sections):
    engine, _, _, _ = shardwise.initialize(model=model, config=_config(**sections))
    return engine


def _steps(engine, count):
    tokens = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(count):
        engine.backward(engine(tokens, tokens))
        engine.step()


def test_custom_schedule_pld_theta_and_eval_forward():
    model = _Recording()
    engine = _engine(
        model,
        curriculum_learning={**CURRICULUM, "schedule_type": "custom", "schedule_config": {}},
        progressive_layer_drop={"enabled": True, "theta": 0.5, "gamma": 0.1},
    )
    assert engine.curriculum_enabled_legacy() and engine.curriculum_params_legacy()["schedule_type"] == "custom"
    engine.set_custom_curriculum_learning_schedule(lambda step: 2 + step)
    _steps(engine, 3)
    assert [seen[0] for seen in model.seen] == [3, 4, 5]
    assert engine.get_pld_theta() == 0.5 * math.exp(-0.1 * 2) + 0.5 == engine.progressive_layer_drop.get_theta()
    assert engine.curriculum_scheduler_legacy.get_current_difficulty() == 5
    engine.eval()
    engine(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    assert model.seen[-1] == (None, False, None)  # eval forwards get no keywords, as in DeepSpeed


def test_engine_methods_without_the_sections():
    engine = _engine(TinyMLP(seed=1))
    assert engine.get_pld_theta() is None and not engine.curriculum_enabled_legacy()
    assert engine.progressive_layer_drop is None and engine.curriculum_scheduler_legacy is None
    with pytest.raises(ValueError, match=r"'curriculum_learning' section, which must be enabled"):
        engine.set_custom_curriculum_learning_schedule(lambda step: step)
    with pytest.raises(ValueError, match=r"\{metric: fn\}\) sets the schedules of the data_efficiency curriculum"):
        engine.set_custom_curriculum_learning_schedule({"seqlen": lambda step: step})


def test_the_metric_schedules_and_the_post_process_go_to_the_curriculum_loader():
    class Sampler:
        def set_custom_curriculum_learning_schedule(self, schedules):
            self.schedules = schedules

    class Loader:
        data_sampler, post_process_func = Sampler(), None

    engine = _engine(TinyMLP(seed=1))
    engine.training_dataloader = Loader()
    schedules, post = {"seqlen": lambda step: step}, lambda batch, state: batch
    engine.set_custom_curriculum_learning_schedule(schedules)
    engine.set_data_post_process_func(post)
    assert Loader.data_sampler.schedules is schedules and engine.training_dataloader.post_process_func is post


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        ({"curriculum_learning": CURRICULUM}, r"keyword 'curriculum_seqlen'.*truncate_to_curriculum"),
        ({"progressive_layer_drop": {"enabled": True}}, r"keyword 'progressive_layer_drop'.*drop_layer"),
    ],
)
def test_a_model_without_the_keywords_is_told_which_and_how(sections, match):
    engine = _engine(TinyMLP(seed=1), **sections)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(TypeError, match=match):
        engine(tokens, tokens)


def test_curriculum_truncation_wraps_a_model_without_the_keyword():
    model = TinyMLP(seed=1)
    engine = _engine(CurriculumTruncation(model), curriculum_learning=CURRICULUM)
    tokens = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    loss = engine(tokens, tokens)
    assert torch.equal(loss, model(tokens[:, :2], tokens[:, :2]))  # step 1 of the schedule: 2 tokens


def test_a_pipeline_module_is_refused_by_name(tmp_path):
    from shardwise.pipe import PipelineModule
    from shardwise.testing.models import PipelineBlock

    # a PipelineModule needs a process group to be built (the autouse fixture destroys it)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    model = PipelineModule([PipelineBlock(4), PipelineBlock(4)], num_stages=1, loss_fn=nn.MSELoss())
    with pytest.raises(ConfigError, match=r"'progressive_layer_drop' act on the model's forward .* PipelineModule"):
        _engine(model, progressive_layer_drop={"enabled": True})


def test_truncate_to_curriculum_cuts_every_sequence_tensor():
    batch = {"ids": torch.arange(12).view(2, 6), "weights": torch.ones(2), "nested": [torch.zeros(2, 6, 3)], "n": 3}
    cut = truncate_to_curriculum(batch, 4)
    assert cut["ids"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert cut["weights"].shape == (2,) and cut["nested"][0].shape == (2, 4, 3) and cut["n"] == 3
    assert truncate_to_curriculum(batch, None) is batch
    assert truncate_to_curriculum(torch.zeros(2, 3), 8).shape == (2, 3)
    pair = collections.namedtuple("Pair", "tokens targets")(torch.zeros(2, 6), torch.zeros(2, 6))
    cut_pair = truncate_to_curriculum(pair, 2)
    assert type(cut_pair) is type(pair) and cut_pair.targets.shape == (2, 2)


def test_progressive_layer_drop_follows_theta_and_gamma():
    for theta in (0.0, 0.1, 0.9, 1.0):
        schedule = ProgressiveLayerDrop(theta=theta, gamma=0.001)
        assert schedule.get_theta() == 1.0
        for step in (0, 1, 10, 5000):
            schedule.update_state(step)
            assert schedule.get_theta() == (1.0 - theta) * math.exp(-0.001 * step) + theta
    assert schedule.get_state() == {"progressive_layer_drop": True, "pld_theta": schedule.get_theta()}


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


def test_drop_layer_keeps_each_block_with_its_probability():
    assert [layer_keep_probability(0.5, i, 4) for i in range(4)] == [0.875, 0.75, 0.625, 0.5]
    with pytest.raises(ValueError, match="layer_index"):
        layer_keep_probability(0.5, 4, 4)
    block, x = _Double(), torch.ones(3)
    draws = torch.rand(200, generator=torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(5)
    ran = [
        drop_layer(block, x, theta=0.5, layer_index=1, num_layers=4, generator=generator)[0].item() == 2.0
        for _ in range(200)
    ]
    assert ran == (draws < 0.75).tolist() and 0 < sum(ran) < 200
    block.eval()
    assert drop_layer(block, x, theta=0.0, layer_index=3, num_layers=4)[0].item() == 2.0
    block.train()
    assert drop_layer(block, x, theta=None, layer_index=3, num_layers=4)[0].item() == 2.0
