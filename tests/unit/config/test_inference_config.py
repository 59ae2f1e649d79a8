"""``init_inference``'s config: DeepSpeed's keys, aliases and defaults from a dict, a JSON
file or keyword arguments (keyword arguments win); unknown keys get a close match, keys
asking for what this version cannot do are refused by name."""

import json

import pytest
import torch

from shardwise.config._errors import ConfigError
from shardwise.config._inference import InferenceConfig, inference_config


def test_defaults_are_deepspeeds():
    cfg = inference_config()
    assert cfg.dtype == torch.float16 and cfg.tp_size == 1 and cfg.max_out_tokens == 1024
    assert not cfg.replace_with_kernel_inject and not cfg.enable_cuda_graph and cfg.return_tuple
    assert not cfg.int8_weights


def test_dict_json_file_and_keyword_arguments_merge(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp16", "tensor_parallel": {"tp_size": 2}, "max_tokens": 64}))
    cfg = inference_config(str(path), dtype=torch.float32, kernel_inject=True)
    assert (cfg.dtype, cfg.tp_size, cfg.max_out_tokens, cfg.replace_with_kernel_inject) == (torch.float32, 2, 64, True)
    assert inference_config({"tp": {"tp_size": 4}}).tp_size == 4
    assert inference_config({"dtype": "bfloat16"}).dtype == torch.bfloat16
    assert inference_config(dtype="torch.int8").int8_weights


def test_legacy_mp_size_is_tp_size(caplog):
    assert inference_config(mp_size=2).tp_size == 2
    assert "mp_size is deprecated" in caplog.text
    with pytest.raises(ConfigError, match=r"mp_size \(2\) and tensor_parallel.tp_size \(4\) differ"):
        inference_config(mp_size=2, tensor_parallel={"tp_size": 4})


def test_quant_section_means_int8_weights():
    assert inference_config(dtype=torch.float32, quant={"enabled": True}).int8_weights
    assert not inference_config(quant={"enabled": False}).int8_weights
    with pytest.raises(ConfigError, match="only 8-bit weights"):
        inference_config(quant={"enabled": True, "weight": {"num_bits": 4}})
    with pytest.raises(ConfigError, match="only weights are quantised"):
        inference_config(quant={"enabled": True, "activation": {"enabled": True}})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("replace_with_kernal_inject", True, "did you mean 'replace_with_kernel_inject'"),
        ("max_out_token", 10, "did you mean 'max_out_tokens'"),
        ("use_triton", True, "without Triton kernels"),
        ("zero", {"stage": 3}, "ZeRO-Inference"),
        ("moe", {"ep_size": 2, "type": "residual"}, "only 'standard' MoE layers"),
        ("ep_group", object(), "shardwise builds the expert groups itself"),
        ("moe", {"ep_size": 0}, "moe.ep_size must be a positive integer"),
        ("save_mp_checkpoint_path", "/tmp/x", "saving the tensor-parallel shards"),
        ("dtype", "fp8", "dtype must be a torch dtype or one of"),
        ("dtype", torch.int32, "dtype must be float32, float16, bfloat16 or int8"),
        ("max_out_tokens", 0, "max_out_tokens must be a positive integer"),
        ("tensor_parallel", {"tp_sise": 2}, "did you mean 'tensor_parallel.tp_size'"),
        ("triangular_masking", False, "causal"),
        ("training_mp_size", 2, "checkpoints split by model parallelism"),
        ("ckpt_config", {"checkpoint_dir": "/ckpt"}, "name the checkpoint with checkpoint="),
    ],
)
def test_bad_input_is_refused_by_name(key, value, message):
    with pytest.raises(ConfigError, match=message):
        inference_config(**{key: value})


def test_moe_ep_size_is_read_from_deepspeeds_places():
    assert inference_config(moe={"enabled": True, "ep_size": 2}).ep_size == 2
    assert inference_config(ep_size=4).ep_size == 4  # the legacy top-level key
    assert inference_config(moe={"enabled": False, "ep_size": 2}).ep_size == 1
    assert inference_config(moe=True).ep_size == 1


def test_alias_and_name_with_different_values_is_refused():
    with pytest.raises(ConfigError, match="alias 'max_tokens'"):
        inference_config({"max_out_tokens": 8}, max_tokens=16)


def test_missing_or_invalid_json_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        inference_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        inference_config(str(bad))


def test_config_object_passes_through():
    cfg = InferenceConfig(dtype=torch.float32)
    assert inference_config(cfg) is cfg


def test_deepspeeds_config_class_takes_its_keywords():
    from shardwise.inference.config import DeepSpeedInferenceConfig

    cfg = DeepSpeedInferenceConfig(tensor_parallel={"tp_size": 2}, kernel_inject=True, dtype=torch.float32)
    assert isinstance(cfg, DeepSpeedInferenceConfig) and isinstance(cfg, InferenceConfig)
    assert (cfg.tp_size, cfg.replace_with_kernel_inject, cfg.dtype) == (2, True, torch.float32)
    assert repr(cfg).startswith("DeepSpeedInferenceConfig(dtype=torch.float32")
    with pytest.raises(ConfigError, match="did you mean 'max_out_tokens'"):
        DeepSpeedInferenceConfig(max_out_token=8)
    assert inference_config(cfg) is cfg  # what init_inference(model, config=cfg) reads
    assert inference_config(triangular_masking=True, training_mp_size=1, ckpt_config={}).tp_size == 1
