"""Generation: the fast decoder's loop with Hugging Face ``generate`` semantics, and the
timings users ask for (time to first token, tokens per second).

The fast loop serves the arguments that greedy decoding and plain sampling use
(``max_new_tokens``, ``max_length``, ``do_sample``, ``temperature``, ``top_k``,
``top_p``, ``eos_token_id``, ``pad_token_id``, ``attention_mask``, a
``generation_config``) with the model's ``generation_config`` defaults, and reproduces
``generate``'s choices: the same logits warpers (Hugging Face's own classes, in its
order), one ``torch.multinomial`` draw per step, position ids counted over the attention
mask, finished rows padded with ``pad_token_id``. Any other argument (beam search,
repetition penalty, streamers...) goes to the model's own ``generate``, which gives the
same tokens, more slowly.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

_FAST_KWARGS = {
    "input_ids",
    "inputs",
    "attention_mask",
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "pad_token_id",
    "generation_config",
    "use_cache",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
}
_NEUTRAL = {
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "bad_words_ids": (None,),
    "typical_p": (None, 1.0),
    "min_p": (None,),
    "top_h": (None,),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "guidance_scale": (None, 1.0),
    "penalty_alpha": (None,),
    "stop_strings": (None,),
    "max_time": (None,),
    "renormalize_logits": (None, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "exponential_decay_length_penalty": (None,),
    "watermarking_config": (None,),
    "force_words_ids": (None,),
    "constraints": (None,),
    "prompt_lookup_num_tokens": (None,),
    "assistant_model": (None,),
    "num_assistant_tokens": (None, 20),
}
"""Generation settings the fast loop leaves out, with the values at which they do nothing."""


@dataclass
class GenerationStats:
    """Timings of the last ``generate`` call."""

    batch_size: int = 0
    prompt_tokens: int = 0
    """Prompt length (padding included)."""
    new_tokens: int = 0
    """Decoding steps taken (tokens added to each sequence)."""
    time_to_first_token_s: float = 0.0
    """From the call to the first new token of every sequence (the prompt's forward)."""
    total_s: float = 0.0
    """The whole call."""

    @property
    def tokens_per_s(self) -> float:
        """New tokens of all sequences per second of the whole call."""
        return self.batch_size * self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after the first one (the decode steps alone)."""
        decode = self.total_s - self.time_to_first_token_s
        return self.batch_size * (self.new_tokens - 1) / decode if decode > 0 and self.new_tokens > 1 else 0.0


@dataclass
class Request:
    """One generate call the fast loop serves."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    max_new_tokens: int
    do_sample: bool
    warpers: list
    eos: torch.Tensor | None
    pad_token_id: int | None
    return_dict: bool = False
    """Return a ``GenerateDecoderOnlyOutput`` (``return_dict_in_generate``)."""
    keep_scores: bool = False
    """Keep each step's processed scores (``output_scores``)."""
    keep_logits: bool = False
    """Keep each step's raw logits (``output_logits``)."""


def fast_request(module, args: tuple, kwargs: dict) -> Request | str:
    """The request ``generate(*args, **kwargs)`` makes of the fast loop, or (a string) why
    it needs the model's own ``generate``."""
    if len(args) > 1:
        return "positional arguments after the input ids"
    unknown = sorted(set(kwargs) - _FAST_KWARGS)
    if unknown:
        return f"arguments {unknown}"
    kwargs = dict(kwargs)
    input_ids = args[0] if args else kwargs.pop("input_ids", kwargs.pop("inputs", None))
    kwargs.pop("input_ids", None), kwargs.pop("inputs", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "input ids that are not a [batch, length] tensor"
    attention_mask = kwargs.pop("attention_mask", None)
    if kwargs.pop("use_cache", True) is False:
        return "use_cache=False"
    config = copy.deepcopy(kwargs.pop("generation_config", None) or module.generation_config)
    config.update(**kwargs)
    for name, neutral in _NEUTRAL.items():
        if getattr(config, name, None) not in neutral:
            return f"generation setting {name}={getattr(config, name)!r}"
    prompt = input_ids.shape[1]
    if config.max_new_tokens is not None:
        new = config.max_new_tokens
    else:
        new = (config.max_length if config.max_length is not None else 20) - prompt
    eos = config.eos_token_id
    eos = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=input_ids.device)
    pad = config.pad_token_id
    if pad is None and eos is not None:
        pad = int(eos[0])
    if attention_mask is None:
        attention_mask = _default_mask(input_ids, pad, eos)
    return Request(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max(new, 0),
        do_sample=bool(config.do_sample),
        warpers=_warpers(config) if config.do_sample else [],
        eos=eos,
        pad_token_id=pad,
        return_dict=bool(config.return_dict_in_generate),
        keep_scores=bool(config.output_scores),
        keep_logits=bool(config.output_logits),
    )


def _default_mask(input_ids: torch.Tensor, pad: int | None, eos: torch.Tensor | None) -> torch.Tensor | None:
    """``generate``'s mask when none is given: the non-pad tokens when the pad token
    appears in the input and differs from every end-of-sequence token."""
    if pad is None or not bool((input_ids == pad).any()):
        return None
    if eos is not None and bool((eos == pad).any()):
        return None
    return (input_ids != pad).long()


def _warpers(config) -> list:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    temperature = 1.0 if config.temperature is None else config.temperature
    top_k = 50 if config.top_k is None else config.top_k
    top_p = 1.0 if config.top_p is None else config.top_p
    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


def run_fast(
    decoder, request: Request, *, max_out_tokens: int, steps=None, shared_prefill: int = 1
) -> tuple[torch.Tensor, GenerationStats]:
    """Generate with the fast decoder; returns the sequences (prompt and new tokens, as
    ``generate`` does) and the timings. With ``steps`` (``StaticSteps``) the decode steps
    run with fixed shapes, as CUDA graphs on a GPU ([Note: decode graphs]). With
    ``shared_prefill`` r > 1 the rows come in groups of r identical prompts (each row
    repeated r times in place, as ``repeat_interleave`` lays them out): the prompt runs
    once per group and its keys, values and logits are copied to the group's rows."""
    start_time = time.perf_counter()
    ids = request.input_ids
    batch, prompt = ids.shape
    total = prompt + request.max_new_tokens
    check_length(prompt, request.max_new_tokens, max_out_tokens)
    stats = GenerationStats(batch_size=batch, prompt_tokens=prompt)
    if request.max_new_tokens == 0:
        return ids, stats  # as generate does, with no step taken
    mask = request.attention_mask
    padded = mask is not None and not bool(mask.all())
    valid = None
    if padded:
        valid = torch.zeros(batch, total, dtype=torch.bool, device=ids.device)
        valid[:, :prompt] = mask.bool()
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    else:
        positions = torch.arange(prompt, device=ids.device).expand(batch, prompt)
    static = steps.get(batch, total) if steps is not None else None
    cache = static.cache if static is not None else decoder.new_cache(batch, total)
    unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
    tokens = [ids]
    kept = {"scores": [], "logits": []}
    with torch.inference_mode():
        prefill_mask = _prefill_mask(valid, prompt, decoder.sliding_window)
        logits = _prefill(decoder, ids, positions, prefill_mask, cache, shared_prefill)
        if static is not None:
            static.prepare(prompt, mask if padded else None)
        for step in range(request.max_new_tokens):
            sequence = torch.cat(tokens, dim=1) if request.warpers else None
            token, scores = _choose(logits, request, sequence)
            if request.keep_logits:
                kept["logits"].append(logits)
            if request.keep_scores:
                kept["scores"].append(scores)
            if request.eos is not None:
                token = torch.where(unfinished, token, torch.full_like(token, request.pad_token_id))
                unfinished &= ~torch.isin(token, request.eos)
            tokens.append(token[:, None])
            if step == 0:
                _sync(ids.device)
                stats.time_to_first_token_s = time.perf_counter() - start_time
            stats.new_tokens = step + 1
            length = prompt + step
            if step == request.max_new_tokens - 1 or (request.eos is not None and not bool(unfinished.any())):
                break
            if static is not None:
                logits = static.step(token)
                if static.graph is not None and (request.keep_logits or request.keep_scores):
                    logits = logits.clone()  # the graph's output is overwritten by the next step
                continue
            if padded:
                valid[:, length] = True
                positions = valid[:, : length + 1].sum(-1, keepdim=True) - 1
                step_mask = _decode_mask(valid, length, decoder.sliding_window)
            else:
                positions = torch.full((batch, 1), length, device=ids.device, dtype=torch.long)
                step_mask = _window_mask(length, decoder.sliding_window, ids.device)
            logits = decoder.forward(token[:, None], positions, step_mask, cache, length)
    sequences = torch.cat(tokens, dim=1)
    _sync(ids.device)
    stats.total_s = time.perf_counter() - start_time
    if not request.return_dict:
        return sequences, stats
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(kept["scores"]) if request.keep_scores else None,
        logits=tuple(kept["logits"]) if request.keep_logits else None,
    ), stats


def _prefill(decoder, ids, positions, mask, cache, repeats: int) -> torch.Tensor:
    """The prompt's forward, once per group of ``repeats`` identical rows: the groups'
    first rows fill the first rows of the cache, whose keys and values are then spread
    over every row of their group (and the logits with them)."""
    if repeats == 1:
        return decoder.forward(ids, positions, mask, cache, 0)
    groups, prompt = ids.shape[0] // repeats, ids.shape[1]
    first = copy.copy(cache)  # the same cache (and rotary table), seen through its first rows
    first.keys, first.values = cache.keys[:, :groups], cache.values[:, :groups]
    first.split_layers()
    rows = slice(None, None, repeats)
    logits = decoder.forward(ids[rows], positions[rows], None if mask is None else mask[rows], first, 0)
    for full, part in ((cache.keys, first.keys), (cache.values, first.values)):
        full[:, :, :, :prompt] = part[:, :, :, :prompt].repeat_interleave(repeats, dim=1)
    return logits.repeat_interleave(repeats, dim=0)


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that timings count it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_length(prompt: int, new: int, max_out_tokens: int) -> None:
    """Refuse a generation that would grow past ``max_out_tokens`` before it starts."""
    if prompt + new > max_out_tokens:
        raise ValueError(
            f"generation would reach {prompt + new} tokens ({prompt} prompt + {new} new), more than "
            f"max_out_tokens={max_out_tokens}; lower max_new_tokens or raise max_out_tokens in "
            "init_inference"
        )


def _choose(logits: torch.Tensor, request: Request, sequence: torch.Tensor | None):
    """The next token of every row, and the processed scores it was chosen from."""
    if not request.do_sample:
        return torch.argmax(logits, dim=-1), logits
    scores = logits
    for warper in request.warpers:
        scores = warper(sequence, scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1), scores


def _prefill_mask(valid: torch.Tensor | None, prompt: int, window: int | None) -> torch.Tensor | None:
    """``[batch, 1, prompt, prompt]`` boolean mask (key visible), or None for plain
    causal attention. Each position always sees itself, so a padding row is finite."""
    if valid is None and (window is None or prompt <= window):
        return None
    device = valid.device if valid is not None else None
    q = torch.arange(prompt, device=device)[:, None]
    k = torch.arange(prompt, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    allowed = allowed[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :prompt]
    return allowed | torch.eye(prompt, dtype=torch.bool, device=device)


def _decode_mask(valid: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """``[batch, 1, 1, length + 1]``: the keys the new token at ``length`` sees."""
    keys = valid[:, None, None, : length + 1].clone()
    if window is not None and length + 1 > window:
        keys[..., : length + 1 - window] = False
    return keys


def _window_mask(length: int, window: int | None, device) -> torch.Tensor | None:
    if window is None or length + 1 <= window:
        return None
    keys = torch.ones(1, 1, 1, length + 1, dtype=torch.bool, device=device)
    keys[..., : length + 1 - window] = False
    return keys


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new tokens arrive."""

    def __init__(self, start: float) -> None:
        self.start, self.calls, self.first = start, 0, 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def run_model_generate(module, args: tuple, kwargs: dict, *, max_out_tokens: int):
    """The model's own ``generate``, timed (time to first token through a streamer
    unless the caller passed one)."""
    start = time.perf_counter()
    clock = None
    if kwargs.get("streamer") is None and kwargs.get("num_beams", 1) in (None, 1):
        clock = _FirstTokenClock(start)
        kwargs = {**kwargs, "streamer": clock}
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    prompt = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0
    if kwargs.get("max_new_tokens") is not None:
        check_length(prompt, kwargs["max_new_tokens"], max_out_tokens)
    with torch.inference_mode():
        out = module.generate(*args, **kwargs)
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    stats = GenerationStats(
        batch_size=ids.shape[0] if prompt else 0, prompt_tokens=prompt, total_s=time.perf_counter() - start
    )
    if isinstance(sequences, torch.Tensor) and prompt:
        stats.new_tokens = sequences.shape[1] - prompt
    stats.time_to_first_token_s = clock.first if clock is not None else 0.0
    return out, stats
