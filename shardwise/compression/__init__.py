"""``deepspeed.compression``: DeepSpeed 0.19.8 keeps only ``compression.helper`` (the
compression library was removed); its helpers live in ``shardwise.utils._modules``."""
