"""Checkpoints across layouts: saved at tensor 2 x data 2 (ZeRO 0-3), a checkpoint loads at
data 4, at tensor 2 x data 1, at tensor 1 on one process, at tensor 2 x data 2 again (and
GPT-2 at tensor 4), and training continues as if never stopped; the consolidated export, the 16-bit model and
``module_state_dict()`` are the plain Hugging Face state dict.

Three spawns share one save directory: 4 ranks save every case and load at data 4 and
tensor 2 x data 2, 2 ranks load at tensor 2 x data 1 (and check a model of other sizes is
refused), 1 rank loads into the plain model. The parent compares everything with one
single-process reference run per model family (plain SGD with momentum, so the optimizer
state is exercised; tolerance 1e-4 of what training moved the weights)."""

import copy
import hashlib
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import shardwise
from shardwise.checkpoint import CheckpointError, consolidate
from shardwise.testing import run_distributed
from shardwise.testing.parity import STAGE3_PARTITION_ALL, full_parameters

MICRO, GLOBAL, VOCAB, SEQ, LR, MOMENTUM = 2, 8, 64, 8, 0.1, 0.9
SAVED, MORE = 1, 1
"""Steps before the save, and after the load: one each, since training is most of this
module's time. After one SGD step the momentum buffers hold that step's gradients, so the
step after a load reads every optimizer state the checkpoint resharded; a lost or misplaced
one moves the weights by about as much as training does."""
OF_MOVEMENT = 1e-4
BF16 = 2.0**-7
"""bf16 weights: two roundings (2^-8 each) of the value, on top of 5% of the movement."""
CASES = (
    [("llama", stage, "fp32") for stage in range(4)]
    + [("gpt2", stage, "fp32") for stage in range(4)]
    + [("llama", 0, "bf16"), ("gpt2", 2, "bf16")]
)
"""(family, ZeRO stage at the save, dtype); a load at data 4 uses the next stage."""


def _name(case) -> str:
    return "-".join(map(str, case))


def _model(family: str, *, seed: int = 0, intermediate: int = 64):
    torch.manual_seed(seed)
    if family == "llama":  # grouped-query attention, untied embeddings
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=intermediate,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    else:  # Conv1D, stacked q/k/v, tied embeddings
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=1,
            n_head=4,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    config.use_cache = False
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g) for _ in range(SAVED + MORE)]


def _config(stage: int, dtype: str, tp: int) -> dict:
    config = {
        "gradient_clipping": 0.0,
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2000,
            **(STAGE3_PARTITION_ALL if stage == 3 else {}),
        },
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


def _engine(family, stage, dtype, tp, *, seed=0, intermediate=64):
    engine, *_ = shardwise.initialize(
        model=_model(family, seed=seed, intermediate=intermediate), config=_config(stage, dtype, tp)
    )
    return engine


def _train(engine, batches):
    dp, dp_rank, gas = engine.grid.data, engine.grid.get_data_parallel_rank(), engine.gradient_accumulation_steps()
    for ids in batches:
        for micro in range(gas):
            start = (micro * dp + dp_rank) * MICRO
            chunk = ids[start : start + MICRO]
            engine.backward(engine(input_ids=chunk, labels=chunk).loss)
            engine.step()


def _full_parameters(engine) -> dict:
    """The model's parameters as the single-process model holds them, in fp32."""
    return {name: value.float() for name, value in full_parameters(engine).items()}


def _digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _save_and_load_at_4(rank, world_size, save_dir):
    """Save every case at tensor 2 x data 2; load each at data 4 (the next ZeRO stage) and
    at tensor 2 x data 2 again (fp32: at stage 3, or 1 for a stage-3 save), continuing
    training; one GPT-2 case also at tensor 4."""
    batches = _batches()
    out = {}
    for case in CASES:
        family, stage, dtype = case
        name = _name(case)
        engine = _engine(family, stage, dtype, 2)
        _train(engine, batches[:SAVED])
        engine.save_checkpoint(save_dir, tag=name)
        engine.save_16bit_model(save_dir, f"{name}.safetensors")
        state = engine.module_state_dict()
        gathered = _full_parameters(engine)
        got = {"state": {k: v.float() for k, v in state.items()}, "gathered": gathered}
        if dtype != "fp32":  # the uninterrupted run, to compare a resume in the same layout bit for bit
            _train(engine, batches[SAVED:])
            got["straight"] = _full_parameters(engine)
        del engine
        layouts = [("data 4", (stage + 1) % 4, 1)] + (
            [("tensor 2 x data 2", 1 if stage == 3 else 3, 2)] if dtype == "fp32" else [("tensor 2 x data 2", stage, 2)]
        )
        if case == ("gpt2", 2, "fp32"):  # 4 heads: GPT-2 splits 4 ways too
            layouts.append(("tensor 4", 3, 4))
        for label, load_stage, tp in layouts:
            resumed = _engine(family, load_stage, dtype, tp, seed=7)
            resumed.load_checkpoint(save_dir, tag=name)
            steps = resumed.global_steps
            if dtype != "fp32" and tp == 1:  # re-save at this layout: consolidates to the same masters
                resumed.save_checkpoint(save_dir, tag=f"{name}-again")
            _train(resumed, batches[SAVED:])
            got[label] = (steps, _full_parameters(resumed))
        out[name] = got
    return out if rank == 0 else None


def _load_at_tp2(rank, world_size, save_dir):
    """Load every case at tensor 2 x data 1 (its save stage) and continue; a model of other
    sizes is refused before anything is loaded or written."""
    batches = _batches()
    out = {}
    for case in CASES:
        family, stage, dtype = case
        engine = _engine(family, stage, dtype, 2, seed=7)
        engine.load_checkpoint(save_dir, tag=_name(case))
        _train(engine, batches[SAVED:])
        out[_name(case)] = _full_parameters(engine)
    engine = _engine("llama", 1, "fp32", 2, seed=7, intermediate=48)
    before, files = engine.module_state_dict(), _digest(Path(save_dir))
    try:
        engine.load_checkpoint(save_dir, tag=_name(CASES[0]))
        out["error"] = None
    except CheckpointError as exc:
        out["error"] = str(exc)
    after = engine.module_state_dict()
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before) and _digest(Path(save_dir)) == files
    return out if rank == 0 else None


def _load_at_tp1(rank, world_size, save_dir):
    """Load every fp32 case into the plain model on one process (ZeRO stage 0) and continue."""
    batches = _batches()
    out = {}
    for case in CASES:
        if case[2] == "fp32":
            engine = _engine(case[0], 0, "fp32", 1, seed=7)
            engine.load_checkpoint(save_dir, tag=_name(case))
            _train(engine, batches[SAVED:])
            out[_name(case)] = _full_parameters(engine)
    return out


def _reference(family):
    """Single-process SGD on the global batches: the parameters after SAVED steps and
    after SAVED + MORE, and the largest movement of any weight."""
    model = copy.deepcopy(_model(family))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    snapshots = []
    for ids in _batches():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
    moved = max((snapshots[-1][n] - initial[n]).abs().max().item() for n in initial)
    return snapshots[SAVED - 1], snapshots[-1], moved, model.state_dict()


def _assert_close(got: dict, want: dict, tolerance: float, what: str, *, relative: float = 0.0):
    """Every |got - want| <= tolerance + relative * |want|."""
    assert sorted(got) == sorted(want), f"{what}: names differ"
    worst = max(
        ((got[n].float() - want[n].float()).abs() - relative * want[n].float().abs()).max().item() for n in want
    )
    assert worst <= tolerance, f"{what}: max |diff| {worst:.3g} > {tolerance:.3g} (+ {relative:.3g} |value|)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Run the three spawns once; the tests below check their results."""
    root = tmp_path_factory.mktemp("tp_checkpoint")
    save_dir = str(root / "ckpt")
    at_4 = run_distributed(_save_and_load_at_4, world_size=4, tmp_path=root, save_dir=save_dir, timeout_s=400)[0]
    at_tp2 = run_distributed(_load_at_tp2, world_size=2, tmp_path=root, save_dir=save_dir)[0]
    at_tp1 = run_distributed(_load_at_tp1, world_size=1, tmp_path=root, save_dir=save_dir)[0]
    references = {family: _reference(family) for family in ("llama", "gpt2")}
    return Path(save_dir), at_4, at_tp2, at_tp1, references


def test_resumed_training_matches_the_uninterrupted_run_in_every_layout(saved):
    save_dir, at_4, at_tp2, at_tp1, references = saved
    for case in CASES:
        family, stage, dtype = case
        name = _name(case)
        after_saved, after_all, moved, _ = references[family]
        tolerance = OF_MOVEMENT * moved
        if dtype == "fp32":
            _assert_close(at_4[name]["gathered"], after_saved, tolerance, f"{name}: before the save")
            for label in [k for k in at_4[name] if k.startswith(("data", "tensor"))]:
                steps, params = at_4[name][label]
                assert steps == SAVED, f"{name} at {label}: global_steps {steps}"
                _assert_close(params, after_all, tolerance, f"{name} loaded at {label}")
            _assert_close(at_tp2[name], after_all, tolerance, f"{name} loaded at tensor 2 x data 1")
            _assert_close(at_tp1[name], after_all, tolerance, f"{name} loaded at tensor 1 on one process")
        else:  # bf16: the same layout resumes bit for bit; the others train on from the fp32 masters
            steps, params = at_4[name]["tensor 2 x data 2"]
            assert all(torch.equal(params[n], at_4[name]["straight"][n]) for n in params), name
            for got, label in ((at_4[name]["data 4"][1], "data 4"), (at_tp2[name], "tensor 2 x data 1")):
                _assert_close(got, after_all, 0.05 * moved, f"{name} loaded at {label}", relative=BF16)


def test_exports_are_the_hugging_face_state_dict(saved, tmp_path):
    from shardwise.tools.convert import convert
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    save_dir, at_4, _, _, references = saved
    for case in CASES:
        family, stage, dtype = case
        name = _name(case)
        after_saved, _, moved, hf_state = references[family]
        state = consolidate(save_dir, name)
        assert list(state) == list(hf_state), f"{name}: keys differ from the model's state_dict"
        assert all(state[k].shape == hf_state[k].shape for k in hf_state), f"{name}: shapes differ"
        want = {
            **after_saved,
            **({"lm_head.weight": after_saved["transformer.wte.weight"]} if family == "gpt2" else {}),
        }
        if dtype == "fp32":
            _assert_close(state, want, OF_MOVEMENT * moved, f"{name}: consolidated")
            # engine.module_state_dict() on every tensor rank is the full state dict too
            assert all(torch.equal(at_4[name]["state"][k], state[k]) for k in state), name
        else:  # the masters, bit for bit through a load and a save at another layout
            again = consolidate(save_dir, f"{name}-again")
            assert all(torch.equal(again[k], state[k]) for k in state), f"{name}: masters changed"
            _assert_close(state, want, 0.05 * moved, f"{name}: consolidated", relative=BF16)
        sixteen = load_file(str(save_dir / f"{name}.safetensors"))
        assert all(sixteen[k].shape == hf_state[k].shape for k in hf_state) and set(sixteen) == set(hf_state), name
        assert all(torch.equal(sixteen[k], at_4[name]["state"][k].to(sixteen[k].dtype)) for k in sixteen), name
    name = _name(CASES[4])  # GPT-2 at stage 0: the conversions agree with consolidate
    state = consolidate(save_dir, name)
    converted = load_file(str(convert(save_dir, tmp_path / "gpt2.safetensors", tag=name)))
    legacy = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=name)
    assert all(torch.equal(converted[k], state[k]) and torch.equal(legacy[k], state[k]) for k in state)
    plain = _model("gpt2", seed=3)
    plain.load_state_dict(state)  # the plain Hugging Face model takes it as is


def test_a_model_of_other_sizes_is_refused_untouched(saved):
    _, _, at_tp2, _, _ = saved
    message = at_tp2["error"]
    assert message is not None, "loading a checkpoint of another size did not fail"
    assert "model.layers.0.mlp.gate_proj.weight" in message and "[64, 32]" in message and "[48, 32]" in message
    assert "saved at ZeRO stage 0, data 2 x tensor 2" in message and "data 1 x tensor 2" in message
    assert "nothing was loaded" in message
    assert at_tp2["untouched"], "a failed load changed the model or the checkpoint"
