"""``init_inference(checkpoint=...)`` at tp 1 into models built on the meta device: every
checkpoint form (a Hugging Face safetensors directory, one file or sharded with an index;
a single .safetensors file; .bin files; DeepSpeed's checkpoint JSON as a dict or a file,
with and without base_dir; a shardwise training checkpoint, fp32 and bf16 with fp32
masters) gives the saved model's logits (fp32, 1e-6) and greedy tokens. Also: key
prefixes, tied heads, a real model overwritten in place, the dtype and marks of the
tensors that replace meta ones, and each refusal by its message. The tensor-parallel
case (each rank reads its slices) is ``tests/dist/inference/test_loading_tp.py``."""

import copy
import json
import weakref

import pytest
import safetensors.torch
import torch
import transformers
from torch import nn

import shardwise
from shardwise.inference._loading import load_checkpoint
from shardwise.testing import run_distributed
from shardwise.testing.causal_lm import FAMILIES, prompts, tiny_lm

NEW = 16


def _meta(reference):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(reference.config)


def _assert_same_model(engine, reference) -> None:
    """The engine's logits equal the reference's (1e-6) and its greedy tokens are the same
    (the reference's outputs are computed once per reference)."""
    want_logits, want_tokens = _outputs(reference)
    single, (batch, mask) = prompts()
    torch.testing.assert_close(engine(batch, attention_mask=mask).logits, want_logits, rtol=0, atol=1e-6)
    for (ids, kwargs), want in zip(((single, {}), (batch, {"attention_mask": mask})), want_tokens, strict=True):
        assert torch.equal(engine.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs), want)


_EXPECTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _outputs(reference):
    if reference not in _EXPECTED:
        single, (batch, mask) = prompts()
        with torch.no_grad():
            logits = reference(batch, attention_mask=mask).logits
        tokens = [
            reference.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)
            for ids, kwargs in ((single, {}), (batch, {"attention_mask": mask}))
        ]
        _EXPECTED[reference] = (logits, tokens)
    return _EXPECTED[reference]


def _load(reference, checkpoint, **kwargs):
    return shardwise.init_inference(_meta(reference), dtype=torch.float32, checkpoint=checkpoint, **kwargs)


def _shard_files(path) -> list[str]:
    return sorted(p.name for p in path.glob("model-*.safetensors"))


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_safetensors_directory_fills_a_meta_model(tmp_path, family):
    reference = tiny_lm(family)
    reference.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert len(_shard_files(tmp_path)) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    _assert_same_model(_load(reference, tmp_path), reference)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_safetensors_file_as_directory_or_file(tmp_path, family):
    reference = tiny_lm(family)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    _assert_same_model(_load(reference, str(tmp_path)), reference)
    _assert_same_model(_load(reference, str(tmp_path / "model.safetensors")), reference)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_deepspeed_checkpoint_json(tmp_path, family):
    reference = tiny_lm(family)
    saved = tmp_path / "saved"
    reference.save_pretrained(saved, safe_serialization=True, max_shard_size="20KB")
    spec = {"type": "BLOOM" if family == "gpt2" else "ds_model", "checkpoints": _shard_files(saved), "version": 1.0}
    _assert_same_model(_load(reference, spec, base_dir=str(saved)), reference)
    beside = saved / "ds_inference_config.json"  # names relative to the JSON file's directory
    beside.write_text(json.dumps(spec))
    _assert_same_model(_load(reference, str(beside)), reference)
    elsewhere = tmp_path / "configs" / "checkpoint.json"  # names relative to base_dir
    elsewhere.parent.mkdir()
    elsewhere.write_text(json.dumps(spec))
    _assert_same_model(
        shardwise.init_inference(
            _meta(reference), {"dtype": "fp32", "checkpoint": str(elsewhere), "base_dir": str(saved)}
        ),
        reference,
    )


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pytorch_bin_files(tmp_path, family):
    reference = tiny_lm(family)
    state = reference.state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    _assert_same_model(_load(reference, tmp_path), reference)
    _assert_same_model(_load(reference, tmp_path / "pytorch_model.bin"), reference)
    keys = sorted(state)
    split = tmp_path / "split"
    split.mkdir()
    torch.save({k: state[k] for k in keys[::2]}, split / "part1.pt")
    torch.save({k: state[k] for k in keys[1::2]}, split / "part2.pt")
    spec = {"type": "ds_model", "checkpoints": ["part1.pt", "part2.pt"], "version": 1.0}
    _assert_same_model(_load(reference, spec, base_dir=str(split)), reference)


def test_module_prefix_and_base_model_checkpoints(tmp_path):
    reference = tiny_lm("gpt2")
    torch.save({f"module.{k}": v for k, v in reference.state_dict().items()}, tmp_path / "wrapped.pt")
    _assert_same_model(_load(reference, tmp_path / "wrapped.pt"), reference)
    # saved from the base model: no "transformer." prefix and no head (tied to wte)
    safetensors.torch.save_file(reference.transformer.state_dict(), str(tmp_path / "base.safetensors"))
    _assert_same_model(_load(reference, tmp_path / "base.safetensors"), reference)


def test_replaced_tensors_keep_dtype_ties_and_need_no_grad(tmp_path):
    reference = tiny_lm("gpt2")
    reference.save_pretrained(tmp_path, safe_serialization=True)
    model = _meta(reference)
    load_checkpoint(model, str(tmp_path), dtype=torch.bfloat16)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives replacement
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad and not param.is_meta, name
        assert torch.equal(param, reference.get_parameter(name).to(torch.bfloat16)), name


def test_a_real_model_is_overwritten_in_place(tmp_path):
    reference = tiny_lm("llama")
    reference.save_pretrained(tmp_path, safe_serialization=True)
    other = tiny_lm("llama", seed=5)
    before = dict(other.named_parameters())
    assert not torch.equal(before["model.norm.weight"], reference.model.norm.weight) or not torch.equal(
        before["lm_head.weight"], reference.lm_head.weight
    )
    engine = shardwise.init_inference(other, dtype=torch.float32, checkpoint=str(tmp_path))
    assert all(engine.module.get_parameter(n) is p for n, p in before.items())  # same tensors, new values
    _assert_same_model(engine, reference)


def _save_training_checkpoints(rank, world_size, root):
    """One process: a gpt2 engine in fp32 (untrained) and a llama engine in bf16 after one
    step, so its fp32 masters differ from its bf16 module weights."""
    for family, precision, steps in (("gpt2", {}, 0), ("llama", {"bf16": {"enabled": True}}, 1)):
        engine, *_ = shardwise.initialize(
            model=tiny_lm(family),
            config={
                "gradient_clipping": 0.0,
                "train_batch_size": 1,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                **precision,
            },
        )
        single, _ = prompts()
        for _ in range(steps):
            engine.backward(engine(single, labels=single).loss)
            engine.step()
        engine.save_checkpoint(f"{root}/{family}")


@pytest.fixture(scope="module")
def training_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    run_distributed(_save_training_checkpoints, world_size=1, tmp_path=root, root=str(root))  # no group here
    return root


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_shardwise_training_checkpoint(training_checkpoints, family):
    from shardwise.checkpoint.layout import consolidate

    save_dir = training_checkpoints / family
    tag = (save_dir / "latest").read_text().strip()
    reference = tiny_lm(family)
    reference.load_state_dict(consolidate(save_dir))  # fp32 masters where the run kept them
    module = safetensors.torch.load_file(str(save_dir / tag / "model.safetensors"))
    if family == "llama":  # bf16 run: loading must take the masters, not the rounded module weights
        assert module["lm_head.weight"].dtype == torch.bfloat16
        assert not torch.equal(reference.lm_head.weight, module["lm_head.weight"].float())
    else:
        assert all(torch.equal(t, tiny_lm(family).state_dict()[k]) for k, t in reference.state_dict().items())
    _assert_same_model(_load(reference, save_dir), reference)  # the tag named by "latest"
    _assert_same_model(_load(reference, str(save_dir / tag)), reference)  # the tag directory itself


# -- refusals -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_lm("llama").save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    return path


def test_missing_checkpoint_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint '.*nowhere' does not exist; check the path"):
        _load(tiny_lm("llama"), str(tmp_path / "nowhere"))


def test_json_naming_missing_files_lists_them(llama_dir):
    spec = {
        "type": "ds_model",
        "checkpoints": [*_shard_files(llama_dir), "gone-1.safetensors", "gone-2.safetensors"],
        "version": 1.0,
    }
    with pytest.raises(
        ValueError,
        match=r"names 2 file\(s\) that do not exist: .*gone-1.safetensors, "
        r".*gone-2.safetensors; .*set base_dir=",
    ):
        _load(tiny_lm("llama"), spec, base_dir=str(llama_dir))


def test_pre_split_deepspeed_json_is_refused(llama_dir):
    spec = {"type": "ds_model", "checkpoints": {"tp": ["tp_00.pt"], "non_tp": ["non_tp.pt"]}, "version": 1.0}
    with pytest.raises(ValueError, match=r"'checkpoints' is a dict .*pre-split .*give the full checkpoint files"):
        _load(tiny_lm("llama"), spec, base_dir=str(llama_dir))


def test_shape_mismatch_names_both_shapes(llama_dir):
    config = copy.deepcopy(tiny_lm("llama").config)
    config.vocab_size = 256
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError,
        match=r"'model.embed_tokens.weight' is \[128, 64\] in .* but the model's "
        r"'model.embed_tokens.weight' is \[256, 64\].*checkpoint's own config",
    ):
        shardwise.init_inference(model, dtype=torch.float32, checkpoint=str(llama_dir))


def test_parameters_absent_from_the_checkpoint_are_listed(tmp_path):
    reference = tiny_lm("llama")
    state = {k: v for k, v in reference.state_dict().items() if k not in ("model.norm.weight", "lm_head.weight")}
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"no tensor for 2 parameter\(s\) of the model: model.norm.weight, "
        r"lm_head.weight \(it holds e.g.",
    ):
        _load(reference, tmp_path)


def test_unreadable_checkpoints_are_refused(tmp_path):
    reference = tiny_lm("llama")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"holds no checkpoint shardwise can read \(\['notes.txt'\]\)"):
        _load(reference, tmp_path / "empty")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match=r"bad.safetensors cannot be read as safetensors"):
        _load(reference, tmp_path / "bad.safetensors")
    torch.save({"weights": reference.state_dict(), "step": object()}, tmp_path / "pickled.bin", pickle_protocol=2)
    with pytest.raises(ValueError, match=r"pickled.bin cannot be read with torch.load\(weights_only=True\)"):
        _load(reference, tmp_path / "pickled.bin")
    (tmp_path / "weights.txt").write_text("1 2 3")
    with pytest.raises(ValueError, match=r"weights.txt is neither .safetensors nor a PyTorch file"):
        _load(reference, tmp_path / "weights.txt")


class _Scaled(nn.Module):
    """A non-transformers model with a buffer no checkpoint holds and no config builds."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)


def test_buffers_left_on_meta_are_named(tmp_path):
    safetensors.torch.save_file(_Scaled().state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(
        ValueError,
        match=r"1 tensor\(s\) are still on the meta device \(scale\).*build the model "
        r"on the CPU",
    ):
        load_checkpoint(model, str(tmp_path))
