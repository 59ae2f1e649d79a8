"""DeepSpeed's ``deepspeed.runtime.fp16.onebit`` path: aliases of ``shardwise.optim.onebit``."""
