"""The fast MoE decoder with experts split over 2 gloo ranks (``moe.ep_size=2``, see
[Note: the fast MoE MLP]): for every MoE family each rank's decoder holds only its rows
of the stacked expert weights, and the engine generates the single-process model's
greedy tokens with its per-step logits (fp32, batch 1 and a left-padded batch), with the
experts sorted by token and with every local expert run on every token (the fixed-shape
decode step, run eagerly). On 4 ranks, tensor parallelism over the attention
(``injection_policy``) combines with experts split 2 ways."""

import copy

import torch

from shardwise.testing import run_distributed

NEW = 12


def _check_family(family: str, rank: int) -> dict:
    import shardwise
    from shardwise.inference._fast_moe import MoEMLP
    from shardwise.inference._graphs import StaticSteps
    from shardwise.testing.causal_lm import prompts, tiny_lm

    reference = tiny_lm(family)
    engine = shardwise.init_inference(
        copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True, moe={"ep_size": 2}
    )
    mlp = engine._decoder.layers[0][4]
    full = reference.model.layers[0].mlp.experts
    held = (
        isinstance(mlp, MoEMLP)
        and mlp.gate_up.shape[0] == mlp.down.shape[0] == 2
        and torch.equal(mlp.gate_up, full.gate_up_proj[2 * rank : 2 * rank + 2].transpose(1, 2))
        and torch.equal(mlp.down, full.down_proj[2 * rank : 2 * rank + 2].transpose(1, 2))
    )
    single, (batch, mask) = prompts()
    report = {"held": held, "tokens": [], "logits": 0.0}
    for sync_free in (False, True):
        for layer in engine._decoder.layers:
            if isinstance(layer[4], MoEMLP):
                layer[4].sync_free = sync_free
        engine._steps = StaticSteps(engine._decoder, graph=False) if sync_free else None
        for ids, kwargs in ((single, {}), (batch, {"attention_mask": mask})):
            kwargs.update(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
            want, got = reference.generate(ids, **kwargs), engine.generate(ids, **kwargs)
            report["tokens"].append(torch.equal(got.sequences, want.sequences))
            same_steps = len(got.logits) == len(want.logits)
            gap = (torch.stack(got.logits) - torch.stack(want.logits)).abs().max() if same_steps else float("inf")
            report["logits"] = max(report["logits"], float(gap))
    return report


def _body(rank, world_size):
    from shardwise.testing.causal_lm import MOE_FAMILIES

    return {family: _check_family(family, rank) for family in MOE_FAMILIES}


def test_fast_moe_decoder_with_experts_split_over_two_ranks(tmp_path):
    for reports in run_distributed(_body, world_size=2, tmp_path=tmp_path):
        for family, report in reports.items():
            assert report["held"], family
            assert all(report["tokens"]) and len(report["tokens"]) == 4, (family, report)
            assert report["logits"] < 1e-4, (family, report)


_ATTENTION = {"mixtral": "MixtralAttention", "qwen2_moe": "Qwen2MoeAttention"}


def _tp_ep_body(rank, world_size):
    import shardwise
    from shardwise.inference._fast_moe import MoEMLP
    from shardwise.testing.causal_lm import prompts, tiny_lm

    _, (batch, mask) = prompts()
    reports = {}
    for family, attention in _ATTENTION.items():
        reference = tiny_lm(family)
        engine = shardwise.init_inference(
            copy.deepcopy(reference),
            dtype=torch.float32,
            replace_with_kernel_inject=True,
            tensor_parallel={"tp_size": 2},
            injection_policy={attention: ("o_proj",)},
            moe={"ep_size": 2},
        )
        mlp = engine._decoder.layers[0][4]
        full = reference.model.layers[0].mlp.experts.gate_up_proj
        kwargs = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
        want, got = (
            reference.generate(batch, attention_mask=mask, **kwargs),
            engine.generate(batch, attention_mask=mask, **kwargs),
        )
        reports[family] = {
            "split": (engine.mp_world_size, mlp.ep_comm.world_size),
            "held": isinstance(mlp, MoEMLP) and torch.equal(mlp.gate_up, full[mlp.low : mlp.low + 2].transpose(1, 2)),
            "tokens": torch.equal(got.sequences, want.sequences),
            "logits": float((torch.stack(got.logits) - torch.stack(want.logits)).abs().max()),
        }
    return reports


def test_fast_moe_decoder_at_tp2_with_experts_split_two_ways(tmp_path):
    for reports in run_distributed(_tp_ep_body, world_size=4, tmp_path=tmp_path):
        for family, report in reports.items():
            assert report["split"] == (2, 2) and report["held"], (family, report)
            assert report["tokens"] and report["logits"] < 1e-4, (family, report)
