"""A training script in the style of DeepSpeed's HelloDeepSpeed BERT example (our own
code): a small masked-language model built under zero.Init, a RepeatingLoader over the
engine's data loader, checkpoints with client_state every few steps, resume from the
latest one, per-parameter state with safe_get_full_*, and offload_states/reload_states
between steps as DeepSpeed's offload_states example does.

Prints `STEP <n> <loss>` lines and one `RESULT {json}` line on rank 0.
"""

import argparse
import json

import torch
from torch import nn

import shardwise as deepspeed
import shardwise.comm as dist
from shardwise.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from shardwise.utils import RepeatingLoader, safe_get_full_optimizer_state


class MaskedLM(nn.Module):
    def __init__(self, vocab=50, width=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, labels):
        logits = self.head(self.encoder(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def masked_dataset(n=96, seq=12, vocab=50):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, vocab, (n, seq), generator=g)
    mask = torch.rand(n, seq, generator=g) < 0.25
    labels = torch.where(mask, tokens, torch.full_like(tokens, -100))
    return torch.utils.data.TensorDataset(torch.where(mask, torch.zeros_like(tokens), tokens), labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint_every", type=int, default=3)
    parser.add_argument("--checkpoint_dir", default="bert_ckpt")
    parser.add_argument("--load_checkpoint_dir", default=None)
    parser.add_argument("--offload", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = MaskedLM()
    partitioned = all(p.numel() == 0 for p in model.parameters())
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=masked_dataset(), config=config
    )
    start = 0
    if args.load_checkpoint_dir:
        _, client_state = engine.load_checkpoint(args.load_checkpoint_dir)
        start = client_state["step"]
    data = RepeatingLoader(loader)
    for _ in range(start * engine.gradient_accumulation_steps()):  # continue the data stream
        next(data)
    for step in range(start + 1, args.steps + 1):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens, labels = next(data)
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
        mean = torch.tensor([loss.item()])
        dist.all_reduce(mean)
        if dist.get_rank() == 0:
            print(f"STEP {step} {float(mean) / dist.get_world_size():.8f}", flush=True)
        if args.offload:
            engine.offload_states(
                include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.lp_grads],
                device=OffloadDeviceEnum.cpu,
                pin_memory=True,
                non_blocking=False,
            )
            engine.reload_states()
        if step % args.checkpoint_every == 0:
            engine.save_checkpoint(args.checkpoint_dir, client_state={"step": step})
    exp_avg = safe_get_full_optimizer_state(engine.module.head.weight, "exp_avg")
    engine.save_16bit_model("hf_out")
    if dist.get_rank() == 0:
        saved = torch.load("hf_out/pytorch_model.bin")
        print(
            "RESULT "
            + json.dumps(
                {
                    "partitioned_at_init": partitioned,
                    "global_steps": engine.global_steps,
                    "exp_avg_shape": list(exp_avg.shape),
                    "saved_head": list(saved["head.weight"].shape),
                    "gas": engine.get_batch_info()[2],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
