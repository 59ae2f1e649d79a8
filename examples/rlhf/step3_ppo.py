"""RLHF step 3: PPO with an actor, a critic, a frozen reference, a reward and an EMA model.

A DeepSpeed-Chat style script on shardwise (the import line is the only switch):

    shardwise run --nproc 2 examples/rlhf/step3_ppo.py \\
        [--actor_model_path /tmp/rlhf/actor] [--reward_model_path /tmp/rlhf/reward]

The actor trains under ZeRO-3 with ``"hybrid_engine": {"enabled": true}``: it generates its
answers through ``actor_engine.module.generate`` (as DeepSpeed-Chat does), which runs on the
fast decoder with the weights of the last optimizer step. Without paths, the actor and
critic start from fresh weights and the reward is the synthetic one (the share of polite
tokens), so the script runs on its own.
"""

import argparse

import torch
import torch.nn.functional as F
import transformers
from rlhf_utils import (
    ANSWER_LEN,
    PROMPT_LEN,
    RewardModel,
    eval_config,
    load_weights,
    prompts,
    rank_slice,
    synthetic_reward,
    tiny_llama_config,
    train_config,
)

import shardwise as deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="Step 3: PPO")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--per_device_generation_batch_size", type=int, default=16)
    parser.add_argument("--actor_learning_rate", type=float, default=5e-3)
    parser.add_argument("--critic_learning_rate", type=float, default=2e-3)
    parser.add_argument("--actor_zero_stage", type=int, default=3)
    parser.add_argument("--critic_zero_stage", type=int, default=3)
    parser.add_argument("--actor_model_path", type=str, default=None, help="step 1's output (default: fresh)")
    parser.add_argument("--reward_model_path", type=str, default=None, help="step 2's output (default: synthetic)")
    parser.add_argument("--enable_ema", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    return parser.parse_args()


def actor_config(args, micro):
    hybrid = {"enabled": True, "max_out_tokens": PROMPT_LEN + ANSWER_LEN, "release_inference_cache": False}
    return train_config(micro, args.actor_learning_rate, args.actor_zero_stage, hybrid_engine=hybrid)


def build_engines(args, micro):
    """The five models of DeepSpeed-Chat's RLHF engine, each under its own DeepSpeed config."""
    config = tiny_llama_config()
    torch.manual_seed(args.seed)
    actor = load_weights(transformers.LlamaForCausalLM(config), args.actor_model_path)
    ref = transformers.LlamaForCausalLM(config)
    ref.load_state_dict(actor.state_dict())
    ema = transformers.LlamaForCausalLM(config) if args.enable_ema else None
    if ema is not None:
        ema.load_state_dict(actor.state_dict())
    critic = load_weights(RewardModel(config), args.reward_model_path)  # the critic starts as the reward model
    reward = load_weights(RewardModel(config), args.reward_model_path) if args.reward_model_path else None

    def frozen(model):
        return None if model is None else deepspeed.initialize(model=model, config=eval_config(micro, 3))[0]

    actor_engine, *_ = deepspeed.initialize(
        model=actor, model_parameters=actor.parameters(), config=actor_config(args, micro)
    )
    critic_engine, *_ = deepspeed.initialize(
        model=critic,
        model_parameters=critic.parameters(),
        config=train_config(micro, args.critic_learning_rate, args.critic_zero_stage),
    )
    return actor_engine, critic_engine, frozen(ref), frozen(reward), frozen(ema)


def gather_logprobs(logits, ids):
    """``log p(ids[t] | ids[:t])`` from logits that predict each next token."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def masked_mean(values):
    """The mean over the answer positions (every answer here has ANSWER_LEN tokens)."""
    return values[:, -ANSWER_LEN:].mean()


class PPOTrainer:
    """DeepSpeed-Chat's PPO trainer in miniature: make experience, then one PPO update of
    the actor and the critic on it."""

    kl_ctl, clip_reward_value, cliprange, cliprange_value, gamma, lam = 0.05, 5.0, 0.2, 0.2, 1.0, 0.95

    def __init__(self, actor, critic, ref, reward, ema):
        self.actor, self.critic, self.ref, self.reward, self.ema = actor, critic, ref, reward, ema

    @torch.no_grad()
    def generate_experience(self, prompt):
        self.actor.eval()
        seq = self.actor.module.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=ANSWER_LEN,
            do_sample=True,
            top_k=0,
            pad_token_id=0,
            synced_gpus=True,  # DeepSpeed-Chat passes it under ZeRO-3; the hybrid engine needs no syncing
        )
        self.actor.train()
        logprobs = gather_logprobs(self.actor(seq).logits[:, :-1], seq[:, 1:])
        ref_logprobs = gather_logprobs(self.ref(seq).logits[:, :-1], seq[:, 1:])
        answers = seq[:, PROMPT_LEN:]
        polite = synthetic_reward(answers)
        score = polite if self.reward is None else self.reward(seq)[:, -1]
        values = self.critic(seq)[:, :-1]
        return dict(seq=seq, logprobs=logprobs, ref_logprobs=ref_logprobs, score=score, values=values, polite=polite)

    def compute_rewards(self, logprobs, ref_logprobs, score):
        """A KL penalty on every answer token, the reward model's score on the last one."""
        rewards = -self.kl_ctl * (logprobs - ref_logprobs)
        rewards[:, -1] += score.clamp(-self.clip_reward_value, self.clip_reward_value)
        return rewards

    def advantages_and_returns(self, values, rewards):
        """Generalised advantage estimation over the answer positions."""
        values, rewards = values[:, -ANSWER_LEN:], rewards[:, -ANSWER_LEN:]
        advantages, last = [], 0.0
        for t in reversed(range(ANSWER_LEN)):
            next_value = values[:, t + 1] if t + 1 < ANSWER_LEN else 0.0
            delta = rewards[:, t] + self.gamma * next_value - values[:, t]
            last = delta + self.gamma * self.lam * last
            advantages.append(last)
        advantages = torch.stack(advantages[::-1], dim=1)
        return advantages, advantages + values

    def train_rlhf(self, exp):
        seq = exp["seq"]
        rewards = self.compute_rewards(exp["logprobs"], exp["ref_logprobs"], exp["score"])
        advantages, returns = self.advantages_and_returns(exp["values"], rewards)
        logprobs = gather_logprobs(self.actor(seq).logits[:, :-1], seq[:, 1:])[:, -ANSWER_LEN:]
        ratio = torch.exp(logprobs - exp["logprobs"][:, -ANSWER_LEN:])
        clipped = ratio.clamp(1.0 - self.cliprange, 1.0 + self.cliprange)
        actor_loss = torch.max(-advantages * ratio, -advantages * clipped).mean()
        self.actor.backward(actor_loss)
        self.actor.step()
        values = self.critic(seq)[:, :-1][:, -ANSWER_LEN:]
        old = exp["values"][:, -ANSWER_LEN:]
        values_clipped = old + (values - old).clamp(-self.cliprange_value, self.cliprange_value)
        critic_loss = 0.5 * torch.max((values - returns) ** 2, (values_clipped - returns) ** 2).mean()
        self.critic.backward(critic_loss)
        self.critic.step()
        if self.ema is not None:
            moving_average(self.actor.module, self.ema.module)
        return actor_loss.item(), critic_loss.item()


def moving_average(model, ema, beta=0.992):
    """EMA of the actor's weights (gathered under ZeRO-3, the EMA's kept from rank 0)."""
    with torch.no_grad():
        for param, param_ema in zip(model.parameters(), ema.parameters()):
            with deepspeed.zero.GatheredParameters([param, param_ema], modifier_rank=0):
                param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))


def world_mean(value):
    """The mean of a scalar over every rank."""
    value = torch.tensor([float(value)])
    deepspeed.comm.all_reduce(value)
    return value.item() / deepspeed.comm.get_world_size()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    world, micro = deepspeed.comm.get_world_size(), args.per_device_generation_batch_size
    trainer = PPOTrainer(*build_engines(args, micro))
    rank = trainer.actor.global_rank
    if rank == 0:
        print(f"actor: {type(trainer.actor).__name__}, ZeRO stage {trainer.actor.zero_optimization_stage()}")
    torch.manual_seed(args.seed + rank)  # each rank samples its own answers
    for step in range(args.steps):
        prompt = rank_slice(prompts(micro * world, seed=args.seed + step), micro)
        exp = trainer.generate_experience(prompt)
        actor_loss, critic_loss = trainer.train_rlhf(exp)
        reward, polite = world_mean(exp["score"].mean()), world_mean(exp["polite"].mean())
        kl = world_mean(masked_mean(exp["logprobs"] - exp["ref_logprobs"]))
        if rank == 0:
            print(
                f"step {step}: reward {reward:.4f}, polite share {polite:.4f}, kl {kl:.4f}, "
                f"actor loss {actor_loss:.4f}, critic loss {critic_loss:.4f}, "
                f"generate {trainer.actor.last_generation.total_s * 1000:.1f} ms",
                flush=True,
            )
    if rank == 0:
        print(f"answers after training: {exp['seq'][:2, PROMPT_LEN:].tolist()}")


if __name__ == "__main__":
    main()
