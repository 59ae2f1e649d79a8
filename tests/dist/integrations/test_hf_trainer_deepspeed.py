"""Hugging Face ``Trainer(args=TrainingArguments(deepspeed=config))`` runs on shardwise
through ``shardwise.install_as_deepspeed()`` (the real DeepSpeed is not installed here).

One job per ZeRO stage runs, on 2 gloo ranks: the Trainer without DeepSpeed (DDP, the
reference), the same Trainer with a DeepSpeed config full of "auto" values, a run resumed
from its step-2 checkpoint, and (stage 3) ``from_pretrained`` under ``HfDeepSpeedConfig``.
Tolerances: fp32 on the CPU; one step at lr 1e-2 moves weights by ~1e-2 (Adam), so 1e-4
on weights and 1e-5 relative on losses are far below one step's change.
"""

import copy
import importlib.util
import os

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")
# not imported here: Accelerate must first be imported after install_as_deepspeed()
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")

MICRO, ACCUMULATION, STEPS, LR, WARMUP = 2, 2, 4, 1e-2, 2


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _deepspeed_config(stage: int) -> dict:
    """Batch sizes, clipping and the optimizer from TrainingArguments ("auto"); at stage 3
    no optimizer section, so the Trainer's own AdamW (with its no-decay group) is used."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
    }
    if stage == 3:
        config["zero_optimization"].update(
            stage3_gather_16bit_weights_on_model_save=True,
            stage3_param_persistence_threshold=0,
            stage3_prefetch_bucket_size="auto",
        )
    else:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
    return config


def _reset_accelerate(deepspeed: bool) -> None:
    """A fresh Accelerate state for the next Trainer. For DeepSpeed, a configured state on
    gloo: Accelerate picks no backend for DeepSpeed on a machine without accelerators
    (on GPUs, TrainingArguments(deepspeed=...) alone is enough)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if deepspeed:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def _train(out_dir, *, config=None, resume=None, weight_decay=0.0):
    _reset_accelerate(config is not None)
    placement = (
        dict(use_cpu=True, ddp_backend="gloo")
        if config is None
        else dict(deepspeed=copy.deepcopy(config), accelerator_config={"use_configured_state": True})
    )
    args = transformers.TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=LR,
        warmup_steps=WARMUP,
        weight_decay=weight_decay,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **placement,
    )
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out_dir / "final"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def _saved(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _max_diff(reference: dict, saved: dict) -> float:
    """Largest difference over the reference's keys. Through Accelerate at stages 1-2 the
    state dict is cloned tensor by tensor (as with DeepSpeed), so the tied output head is
    written too: it must equal the embedding it is tied to."""
    extra = set(saved) - set(reference)
    assert extra <= {"lm_head.weight"} and set(reference) <= set(saved), sorted(set(reference) ^ set(saved))
    if extra:
        assert torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])
    return max((reference[k].float() - saved[k].float()).abs().max().item() for k in reference)


def _partitioned_from_pretrained(rank, config, saved_dir):
    """from_pretrained under HfDeepSpeedConfig (ZeRO-3): built by zero.Init, each rank
    holding only its slice; gathered, the weights are the saved ones."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    keep_alive = HfDeepSpeedConfig(config)
    model = transformers.GPT2LMHeadModel.from_pretrained(str(saved_dir))
    checks = {"zero3_enabled": is_deepspeed_zero3_enabled()}
    params = dict(model.named_parameters())
    checks["partitioned"] = all(p.numel() == 0 and p.ds_tensor.numel() == -(-p.ds_numel // 2) for p in params.values())
    with shardwise.zero.GatheredParameters(list(params.values())):
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved = _saved(saved_dir)
    checks["load_diff"] = max((full[k] - saved[k]).abs().max().item() for k in saved)
    del keep_alive
    return checks


def _stage_job(rank, world_size, stage, out):
    from pathlib import Path

    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # one node (Accelerate asks; the group exists already)
    before = importlib.util.find_spec("deepspeed")
    shardwise.install_as_deepspeed()  # before the Trainer and Accelerate are imported
    import deepspeed

    checks = {
        "real_deepspeed_absent": before is None,
        "alias": deepspeed is shardwise,
        "alias_spec": importlib.util.find_spec("deepspeed").name == "shardwise",
    }
    out, decay = Path(out), 0.1 if stage == 3 else 0.0
    _, checks["reference"] = _train(out / "reference", weight_decay=decay)
    config = _deepspeed_config(stage)
    trainer, checks["deepspeed"] = _train(out / "deepspeed", config=config, weight_decay=decay)
    engine = trainer.model_wrapped
    checks["engine"] = [
        isinstance(engine, deepspeed.DeepSpeedEngine),
        engine.zero_optimization_stage(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
        engine.gradient_clipping(),
    ]
    del trainer, engine
    _, checks["resumed"] = _train(
        out / "resumed", config=config, weight_decay=decay, resume=str(out / "deepspeed" / "checkpoint-2")
    )
    if rank == 0:
        final = _saved(out / "deepspeed" / "final")
        checks["weights_vs_reference"] = _max_diff(_saved(out / "reference" / "final"), final)
        checks["weights_vs_resumed"] = _max_diff(_saved(out / "resumed" / "final"), final)
    if stage == 3:
        concrete = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        checks["from_pretrained"] = _partitioned_from_pretrained(rank, concrete, out / "reference" / "final")
    return checks


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_deepspeed_config_matches_trainer_without(tmp_path, stage):
    results = run_distributed(
        _stage_job,
        world_size=2,
        tmp_path=tmp_path,
        timeout_s=240,
        fresh_processes=True,
        stage=stage,
        out=str(tmp_path / "runs"),
    )
    for _rank, checks in enumerate(results):
        assert checks["real_deepspeed_absent"] and checks["alias"] and checks["alias_spec"]
        assert checks["engine"] == [True, stage, MICRO, ACCUMULATION, 1.0]
        assert len(checks["deepspeed"]) == STEPS
        assert checks["deepspeed"] == pytest.approx(checks["reference"], rel=1e-5)
        # resumed at step 2 (its log starts with the checkpoint's two entries): the last two
        # steps' losses are the uninterrupted run's
        assert len(checks["resumed"]) == STEPS
        assert checks["resumed"][2:] == pytest.approx(checks["deepspeed"][2:], rel=1e-5)
        if stage == 3:
            loaded = checks["from_pretrained"]
            assert loaded["zero3_enabled"] and loaded["partitioned"], loaded
            assert loaded["load_diff"] == 0.0
    assert results[0]["weights_vs_reference"] < 1e-4
    assert results[0]["weights_vs_resumed"] < 1e-5
