"""DeepSpeed's ``deepspeed.runtime.fp16`` package path; only its ``onebit`` optimizers live here (aliases)."""
