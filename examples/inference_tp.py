"""DeepSpeed's inference tutorial, running on shardwise: split a causal LM over the ranks
of the job with tensor parallelism and generate.

The only change from a DeepSpeed inference script is the import line:

    import deepspeed                 ->   import shardwise as deepspeed

Run it with:  shardwise run --nproc 2 examples/inference_tp.py     (or torchrun --nproc-per-node 2)

Without ``--model`` it builds a small random Llama (no download): the tokens are
meaningless, but every rank count gives the same ones.
"""

import argparse
import os

import torch
import transformers

import shardwise as deepspeed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a local Hugging Face model directory (default: a small random Llama)"
    )
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--no_kernel_inject", action="store_true", help="run the model's own forward")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    args = parser.parse_args()

    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    torch.manual_seed(0)  # every rank builds the same model and prompt
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        config = transformers.LlamaConfig(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=1024,
            initializer_range=0.2,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None  # always generate new_tokens tokens

    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": world_size},
        dtype=DTYPES[args.dtype],
        replace_with_kernel_inject=not args.no_kernel_inject,
    )
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, 16))
    output = engine.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
    stats = engine.last_generation
    if local_rank == 0:
        print(f"tp {world_size}: new tokens {output[0, prompt.shape[1] :].tolist()}")
        print(
            f"time to first token {stats.time_to_first_token_s * 1e3:.1f} ms, {stats.tokens_per_s:.1f} tokens/s "
            f"({stats.batch_size} x {stats.new_tokens} tokens in {stats.total_s:.2f} s)"
        )


if __name__ == "__main__":
    main()
