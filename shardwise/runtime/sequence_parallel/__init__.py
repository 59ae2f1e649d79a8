"""DeepSpeed's ``deepspeed.runtime.sequence_parallel`` (Ulysses / ALST for Hugging Face models)."""
