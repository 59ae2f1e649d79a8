"""The fast decoder's decode step with fixed shapes, replayed as a CUDA graph on a GPU.

[Note: decode graphs]
On a GPU a decode step of a small batch is bound by kernel launches, not by arithmetic:
a 22-layer Llama launches a few hundred small kernels per token, and Python issues them
one by one. A CUDA graph records the step's kernels once and replays them with one call.
A graph replays the same kernels on the same memory, so everything that changes from one
step to the next lives in tensors on the GPU that the graph reads:

- the new token (``token``, copied in before each replay),
- where it goes (``index``: its cache position, which the graph itself advances by one),
- which cache positions each row may attend to (``valid``: the prompt's mask, then one
  more position per step, set by the graph).

Attention covers the whole cache (its length is the generation's final length) with
``valid`` as the mask, so its shapes never change; positions not written yet are masked
(and start as zeros: a masked value is still multiplied by its zero weight).
Each row's position is the number of valid keys before it, which is the step index for
rows without padding and the padded generation's position otherwise (the same numbers as
the eager loop). The step is captured once per (batch, final length) and kept with its
cache for later calls of the same shape (``_KEEP`` of them).

Warm-up runs before the capture write a throw-away token at the cache's first positions;
the prompt's prefill overwrites them, and ``prepare`` resets ``valid`` and ``index``.
Tensor parallelism is not captured (its all-reduces would have to be captured with them).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

_KEEP = 4
"""Captured steps kept per decoder (each holds its KV cache and the graph's memory)."""


class StaticStep:
    """One decode step over a cache of fixed length; a CUDA graph when ``graph``."""

    @torch.inference_mode()
    def __init__(self, decoder, batch: int, length: int, *, graph: bool) -> None:
        device = decoder.device
        self.decoder = decoder
        self.cache = decoder.new_cache(batch, length)
        self.cache.keys.zero_()  # unwritten positions are masked, but 0 x NaN in the values would still be NaN
        self.cache.values.zero_()
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, length, dtype=torch.bool, device=device)
        self.key_positions = torch.arange(length, device=device)
        self.graph = None
        self.logits = None
        if graph:
            self._capture()

    def _body(self) -> torch.Tensor:
        self.valid.index_fill_(1, self.index, True)
        positions = self.valid.sum(-1, keepdim=True) - 1
        mask = self.valid[:, None, None, :]
        window = self.decoder.sliding_window
        if window is not None:
            mask = mask & (self.key_positions > self.index - window)
        logits = self.decoder.forward(self.token, positions, mask, self.cache, self.index)
        self.index += 1
        return logits

    def _capture(self) -> None:
        side = torch.cuda.Stream(self.decoder.device)
        side.wait_stream(torch.cuda.current_stream(self.decoder.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # the lazy initialisation of the step's kernels happens outside the graph
                self._body()
        torch.cuda.current_stream(self.decoder.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._body()

    def prepare(self, prompt: int, prompt_mask: torch.Tensor | None) -> None:
        """Start a generation whose prompt (``prompt`` tokens, mask ``prompt_mask`` or none)
        is in the cache."""
        self.valid.zero_()
        self.valid[:, :prompt] = True if prompt_mask is None else prompt_mask.bool()
        self.index.fill_(prompt)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The logits after ``token`` (``[batch]``); a graph's output is overwritten by the next step."""
        self.token.copy_(token[:, None])
        if self.graph is None:
            return self._body()
        self.graph.replay()
        return self.logits


class StaticSteps:
    """The captured steps of one decoder, by (batch, final length)."""

    def __init__(self, decoder, *, graph: bool) -> None:
        self.decoder = decoder
        self.graph = graph
        self._steps: OrderedDict[tuple[int, int], StaticStep] = OrderedDict()

    def get(self, batch: int, length: int) -> StaticStep:
        key = (batch, length)
        step = self._steps.pop(key, None)
        if step is None:
            while len(self._steps) >= _KEEP:
                self._steps.popitem(last=False)
            step = StaticStep(self.decoder, batch, length, graph=self.graph)
        self._steps[key] = step
        return step
