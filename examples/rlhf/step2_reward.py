"""RLHF step 2: a reward model from pairs of answers, one chosen and one rejected.

A DeepSpeed-Chat style script on shardwise (the import line is the only switch):

    shardwise run --nproc 2 examples/rlhf/step2_reward.py --output_dir /tmp/rlhf/reward

The model is the language model's backbone with a scalar head; the loss asks the chosen
answer (the polite one) to score above the rejected one (random tokens).
"""

import argparse

import torch
from rlhf_utils import (
    ANSWER_LEN,
    VOCAB,
    RewardModel,
    pairwise_loss,
    polite_answer,
    prompts,
    rank_slice,
    save_model,
    tiny_llama_config,
    train_config,
)

import shardwise as deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="Step 2: reward model")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=4321)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    return parser.parse_args()


def pairs(prompt, seed):
    """``(chosen, rejected)`` sequences: the prompt with its polite answer, and with random tokens."""
    generator = torch.Generator().manual_seed(seed)
    rejected = torch.randint(3, VOCAB, (prompt.shape[0], ANSWER_LEN), generator=generator)
    return torch.cat([prompt, polite_answer(prompt)], dim=1), torch.cat([prompt, rejected], dim=1)


def main():
    args = parse_args()
    deepspeed.init_distributed()
    world = deepspeed.comm.get_world_size()
    torch.manual_seed(args.seed)
    model = RewardModel(tiny_llama_config())
    micro = args.per_device_train_batch_size
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=train_config(micro, args.learning_rate, args.zero_stage),
    )
    for step in range(args.steps):
        prompt = prompts(micro * world, seed=args.seed + step)
        chosen, rejected = (rank_slice(ids, micro) for ids in pairs(prompt, seed=-args.seed - step))
        # one forward over both halves, as DeepSpeed-Chat's reward model does
        scores = engine(torch.cat([chosen, rejected]))[:, -1]
        chosen_scores, rejected_scores = scores[:micro], scores[micro:]
        loss = pairwise_loss(chosen_scores, rejected_scores)
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            accuracy = (chosen_scores > rejected_scores).float().mean().item()
            print(
                f"step {step}: reward loss {loss.item():.4f}, accuracy {accuracy:.2f}, "
                f"chosen {chosen_scores.mean().item():.3f}, rejected {rejected_scores.mean().item():.3f}",
                flush=True,
            )
    if args.output_dir:
        save_model(engine, args.output_dir)
        if engine.global_rank == 0:
            print(f"saved the reward model to {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
