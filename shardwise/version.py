"""The library's version (``deepspeed.version`` for DeepSpeed scripts)."""

__version__ = "0.1.0"
version = __version__
git_hash = None
git_branch = None
