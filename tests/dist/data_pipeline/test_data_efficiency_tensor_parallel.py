"""The data-efficiency features under tensor parallelism (autotp 2 on 2 ranks): the legacy
seqlen curriculum, progressive layer drop and random-LTD together train a small decoder to
the parameters of single-process training with the same keywords and kept tokens, for SGD
and AdamW; the curriculum data sampler gives both ranks of the tensor-parallel group the
same samples."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.runtime.data_pipeline import drop_layer, truncate_to_curriculum
from shardwise.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from shardwise.runtime.data_pipeline.data_routing import RandomLTD, convert_to_random_ltd
from shardwise.runtime.progressive_layer_drop import ProgressiveLayerDrop
from shardwise.testing import run_distributed
from shardwise.testing.parity import full_parameters

VOCAB, WIDTH, HEAD, LAYERS, SEQ, BATCH, STEPS = 32, 16, 4, 3, 16, 4, 4
CURRICULUM = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": SEQ,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 4},
}
PLD = {"enabled": True, "theta": 0.5, "gamma": 0.5}
RANDOM_LTD = {
    "enabled": True,
    "total_layer_num": LAYERS,
    "random_ltd_layer_num": 1,
    "random_ltd_layer_id": [1],
    "model_mask_name": None,
    "model_type": "decoder",
    "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {
        "min_value": 4,
        "max_value": SEQ,
        "schedule_type": "fixed_linear",
        "schedule_config": {"require_steps": 3, "seq_per_step": 4},
    },
}
OF_MOVEMENT = {"SGD": 1e-5, "AdamW": 2e-3}
"""Largest |engine - reference| allowed, as a fraction of the reference's movement (as in
tests/dist/tensor_parallel/test_autotp.py: AdamW turns reduction-order noise into more)."""
SPECS = [
    {"patterns": [r".*\.(q|k|v|fc)\.(weight|bias)$"], "partition_type": "column"},
    {"patterns": [r".*\.(proj|out)\.weight$"], "partition_type": "row"},
]


class Block(nn.Module):
    """Pre-LN block whose heads follow the local width (autotp splits q/k/v/fc by columns)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.v, self.proj = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        # no key bias: softmax ignores it, so its gradient is rounding noise that AdamW amplifies
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.fc, self.out = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (layer(h).view(b, s, -1, HEAD).transpose(1, 2) for layer in (self.q, self.k, self.v))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.draws = None

    def forward(self, idx, targets, *, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=None):
        if curriculum_seqlen is not None:
            idx, targets = truncate_to_curriculum((idx, targets), curriculum_seqlen)
        if self.draws is None:
            self.draws = torch.Generator().manual_seed(1)
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            x = drop_layer(block, x, theta=pld_theta, layer_index=i, num_layers=LAYERS, generator=self.draws)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _reference(model, optimizer, lr):
    """Single process: the engine's keywords computed by hand, the same kept tokens."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters(), lr=lr, weight_decay=0.0)
    curriculum = CurriculumScheduler(CURRICULUM)
    pld = ProgressiveLayerDrop(theta=PLD["theta"], gamma=PLD["gamma"])
    ltd = RandomLTD.from_config(RANDOM_LTD, model, global_batch_size=BATCH)
    torch.manual_seed(3)
    for step, tokens in enumerate(_batches()):
        ltd.before_forward(step)
        model(
            tokens[:, :-1], tokens[:, 1:], curriculum_seqlen=curriculum.update_difficulty(step + 1), **pld.get_state()
        ).backward()
        pld.update_state(step)
        opt.step()
        opt.zero_grad()
    return model


def _job(rank, world_size, clusters):
    out = {"sampled": _sampled_rows(clusters)}
    for name, optimizer, lr in (("SGD", torch.optim.SGD, 0.5), ("AdamW", torch.optim.AdamW, 1e-2)):
        model = convert_to_random_ltd(Decoder(), Block)
        reference = _reference(model, optimizer, lr)
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "steps_per_print": 1000,
            "gradient_clipping": 0.0,
            "optimizer": {"type": name, "params": {"lr": lr, "weight_decay": 0.0}},
            "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": SPECS}},
            "curriculum_learning": CURRICULUM,
            "progressive_layer_drop": PLD,
            "data_efficiency": {"enabled": True, "data_routing": {"random_ltd": RANDOM_LTD}},
        }
        engine, *_ = shardwise.initialize(model=copy.deepcopy(model), config=config)
        torch.manual_seed(3)  # the same kept tokens on both ranks, and as the reference's
        for tokens in _batches():
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
        got = full_parameters(engine)
        split = (
            engine.module.blocks[0].random_ltd_layer.q.weight.shape[0]
            if hasattr(engine.module.blocks[0], "random_ltd_layer")
            else engine.module.blocks[0].q.weight.shape[0]
        )
        out[name] = (
            max((got[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()),
            max(
                (p.detach() - q.detach()).abs().max().item() for p, q in zip(reference.parameters(), model.parameters())
            ),
            split,
        )
    return out


def _sampled_rows(clusters):
    """Three micro-batches of the curriculum sampler's loader under autotp 2 (the index files
    of tests/unit/data_pipeline, rows of token ids)."""
    import importlib.util
    import os

    unit = os.path.join(os.path.dirname(__file__), "..", "..", "unit", "data_pipeline")
    path = os.path.join(unit, "make_deepspeed_reference.py")
    spec = importlib.util.spec_from_file_location("_sampler_reference", path)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    sampling = ref.sampler_configs(os.path.join(unit, "deepspeed_reference", "analyzer"), clusters)["value"]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": SPECS}},
        "data_efficiency": sampling,
    }
    _, _, loader, _ = shardwise.initialize(model=Decoder(), config=config, training_data=list(ref.analyzer_dataset()))
    batches = iter(loader)
    return [next(batches).tolist() for _ in range(3)]


def test_curriculum_pld_and_random_ltd_under_autotp_match_single_process(tmp_path):
    reports = run_distributed(_job, world_size=2, tmp_path=tmp_path, clusters=str(tmp_path / "clusters"))
    assert reports[0]["sampled"] == reports[1]["sampled"], "the tensor-parallel ranks got other samples"
    for report in reports:
        for name in ("SGD", "AdamW"):
            diff, moved, split = report[name]
            assert split == WIDTH // 2, f"{name}: q is not split ({split} rows)"
            assert moved > 1e-3, f"{name}: training did not move the parameters"
            assert diff < OF_MOVEMENT[name] * moved, f"{name}: max |diff| {diff:.3g}, training moved {moved:.3g}"
