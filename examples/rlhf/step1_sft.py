"""RLHF step 1: supervised fine-tuning of the actor on prompt / answer pairs.

A DeepSpeed-Chat style script on shardwise (the import line is the only switch):

    shardwise run --nproc 2 examples/rlhf/step1_sft.py --output_dir /tmp/rlhf/actor

The loss is the answer tokens' cross-entropy (the prompt is context only).
"""

import argparse

import torch
import transformers
from rlhf_utils import ANSWER_LEN, polite_answer, prompts, rank_slice, save_model, tiny_llama_config, train_config

import shardwise as deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="Step 1: supervised fine-tuning")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    return parser.parse_args()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    world = deepspeed.comm.get_world_size()
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    micro = args.per_device_train_batch_size
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=train_config(micro, args.learning_rate, args.zero_stage),
    )
    for step in range(args.steps):
        prompt = rank_slice(prompts(micro * world, seed=args.seed + step), micro)
        ids = torch.cat([prompt, polite_answer(prompt)], dim=1)
        labels = ids.clone()
        labels[:, :-ANSWER_LEN] = -100  # learn the answer, not the prompt
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step}: sft loss {loss.item():.4f}", flush=True)
    if args.output_dir:
        save_model(engine, args.output_dir)
        if engine.global_rank == 0:
            print(f"saved the actor to {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
