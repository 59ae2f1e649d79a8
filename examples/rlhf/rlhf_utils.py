"""What the three RLHF steps share: the tiny Llama they train, the synthetic task, the
reward model's shape, saving and loading between steps, and the DeepSpeed configs.

The task: a prompt is PROMPT_LEN random tokens; the "human" prefers answers written in a
small polite vocabulary (POLITE token ids). The supervised answer to a prompt is the prompt
mapped into that vocabulary; a rejected answer is random tokens from the whole vocabulary;
the synthetic reward of an answer is the share of its tokens that are polite.
"""

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as deepspeed

VOCAB, PROMPT_LEN, ANSWER_LEN = 64, 8, 8
POLITE = range(3, 19)
"""Token ids of the polite vocabulary (16 of the 64)."""


def tiny_llama_config():
    """A 2-layer Llama of hidden size 64, built from its config (nothing downloaded). No
    end-of-sequence token, so every answer is ANSWER_LEN tokens long."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def prompts(count, seed):
    """``count`` prompts of PROMPT_LEN tokens, the same on every rank for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count, PROMPT_LEN), generator=generator)


def polite_answer(prompt):
    """The supervised (and chosen) answer: each prompt token mapped into POLITE."""
    return POLITE.start + (prompt % len(POLITE))


def synthetic_reward(answers):
    """The share of each answer's tokens that are polite: ``[batch]`` floats in [0, 1]."""
    return ((answers >= POLITE.start) & (answers < POLITE.stop)).float().mean(dim=1)


def rank_slice(batch, micro_batch):
    """This rank's ``micro_batch`` rows of a global batch (plain data parallelism)."""
    rank = deepspeed.comm.get_rank()
    return batch[rank * micro_batch : (rank + 1) * micro_batch]


class RewardModel(nn.Module):
    """The backbone of the language model with a scalar head (DeepSpeed-Chat's reward and
    critic model): ``forward`` gives one value per token, ``score`` the value at the last
    token."""

    def __init__(self, config):
        super().__init__()
        import transformers

        self.config = config
        self.backbone = transformers.LlamaModel(config)
        self.v_head = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, input_ids):
        hidden = self.backbone(input_ids=input_ids).last_hidden_state
        return self.v_head(hidden).squeeze(-1)

    def score(self, input_ids):
        return self(input_ids)[:, -1]


def pairwise_loss(chosen_scores, rejected_scores):
    """The reward model's loss: the chosen answer should score above the rejected one."""
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


def save_model(engine, output_dir):
    """Every rank calls it: the whole weights (gathered under ZeRO-3) and the config."""
    engine.save_16bit_model(output_dir)
    if deepspeed.comm.get_rank() == 0:
        with open(os.path.join(output_dir, "config.json"), "w") as handle:
            json.dump(engine.module.config.to_dict(), handle)


def load_weights(model, path):
    """Fill ``model`` from a directory ``save_model`` wrote (None: keep its initialisation)."""
    if path:
        state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    return model


def train_config(micro_batch, lr, stage, **extra):
    """A DeepSpeed config for a trained model."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        **extra,
    }


def eval_config(micro_batch, stage):
    """A DeepSpeed config for a frozen model (reference, reward, EMA): no optimizer."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": stage}}
