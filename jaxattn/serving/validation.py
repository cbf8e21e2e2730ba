"""Every check of a request, in one place: what a caller may ask and what this engine can hold.

Two callers run them, and nothing else checks a request:

* `SamplingParams` (`jaxattn.serving.requests`) runs `check_sampling` when it is built: each field in
  its own range, whatever engine it will meet;
* `Engine.add_request` runs `check_request`: the prompt and the sampling against the engine's
  `RequestLimits` (the vocabulary, the context, the pool, the detokenizer).

The HTTP layer (`jaxattn.serving.api`) only parses JSON into types and refuses the OpenAI fields it does not
support; a `RequestError` from here becomes its 400, with the error's `param` (named as the engine names
it, e.g. "prompt", "max_tokens"; the API renames them to its endpoint's fields) and `code`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxattn._validate import is_int

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt and output past the context
MAX_LOGPROBS = 20  # the most top log-probabilities a token may ask for (OpenAI's limit; one static top-k per step)
MAX_LOGIT_BIAS = 256  # entries of one request's logit_bias: the step's bias arrays are [M, MAX_LOGIT_BIAS]
MAX_CHOICES = 16  # the most sequences one request may ask for (n, best_of)
MAX_TOP_K = 2**31 - 1  # top_k is an int32 on the device (any k past the vocabulary keeps every token)
# Stop strings are matched against the text as each token arrives, on the engine's loop: bounded so that one
# request's cannot stall the others' steps (OpenAI takes 4 of them; vLLM does not bound them).
MAX_STOPS, MAX_STOP_CHARS = 16, 1024


class RequestError(ValueError):
    """A request refused: a ValueError carrying the OpenAI parameter it is about and an OpenAI code.

    Attributes:
      param: the parameter at fault, as `SamplingParams` and `add_request` name it ("prompt",
        "max_tokens", "temperature", ...), or None.
      code: a machine-readable reason where OpenAI has one (`CONTEXT_LENGTH_EXCEEDED`), else None.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one engine can take: a request is checked against these.

    Attributes:
      vocab_size: prompt and stop token ids lie in `[0, vocab_size)`.
      max_model_len: the longest prompt + output.
      num_pages, page_size: the pool; one sequence must fit in it whole.
      detokenizer: the engine turns ids into text (stop strings need it).
      guides: the engine compiles guides (it knows its tokenizer's vocabulary).
      token_history: the engine keeps every token of a running sequence on the device (the
        penalties need it); False where pages behind a sliding window are given back.
    """

    vocab_size: int
    max_model_len: int
    num_pages: int
    page_size: int
    detokenizer: bool
    guides: bool = False
    token_history: bool = True


# -- the sampling fields, alone --------------------------------------------------------------

def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sampling(sampling) -> None:
    """RequestError naming the first `SamplingParams` field out of its range (`param` = the field)."""
    if not (_number(sampling.temperature) and math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise RequestError(f"temperature must be a finite number >= 0, got {sampling.temperature!r}",
                           param="temperature")
    if not is_int(sampling.top_k, numpy=False) or not 0 <= sampling.top_k <= MAX_TOP_K:
        raise RequestError(f"top_k must be an int in [0, {MAX_TOP_K}] (0 = off), got {sampling.top_k!r}",
                           param="top_k")
    if not (_number(sampling.top_p) and 0.0 < sampling.top_p <= 1.0):
        raise RequestError(f"top_p must be in (0, 1], got {sampling.top_p!r}", param="top_p")
    if sampling.max_tokens is not None and (not is_int(sampling.max_tokens, numpy=False) or sampling.max_tokens < 0):
        raise RequestError(f"max_tokens must be an int >= 1 (0 with prompt_logprobs; None: up to the context), "
                           f"got {sampling.max_tokens!r}",
                           param="max_tokens")
    _check_logprobs(sampling)
    if sampling.seed is not None and not is_int(sampling.seed, numpy=False):
        raise RequestError(f"seed must be an int or None, got {sampling.seed!r}", param="seed")
    _check_stop(sampling.stop)
    if any(not is_int(t) for t in sampling.stop_token_ids):
        raise RequestError(f"stop_token_ids must be ints, got {sampling.stop_token_ids!r}", param="stop_token_ids")
    _check_logit_knobs(sampling)
    if sampling.lora is not None and (not isinstance(sampling.lora, str) or not sampling.lora):
        raise RequestError(f"lora must be an adapter's name (a non-empty str) or None, got {sampling.lora!r}",
                           param="lora")


def _check_stop(stop: tuple) -> None:
    if any(not isinstance(s, str) or not s for s in stop):
        raise RequestError(f"stop must hold non-empty strings, got {str(stop)[:200]}", param="stop")
    if len(stop) > MAX_STOPS:
        raise RequestError(f"stop may hold at most {MAX_STOPS} strings, got {len(stop)}", param="stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise RequestError(f"a stop string may be at most {MAX_STOP_CHARS} characters, got one of {longest:,}",
                           param="stop")


def _in_range(value, low: float, high: float) -> bool:
    return _number(value) and math.isfinite(value) and low <= value <= high


def _check_logit_knobs(sampling) -> None:
    """The penalties, min_p and logit_bias: each in its range (OpenAI's for the first two and the bias)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if not _in_range(getattr(sampling, name), -2.0, 2.0):
            raise RequestError(f"{name} must be in [-2, 2], got {getattr(sampling, name)!r}", param=name)
    penalty = sampling.repetition_penalty
    if not (_number(penalty) and math.isfinite(penalty) and penalty > 0):
        raise RequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {penalty!r}",
                           param="repetition_penalty")
    if not _in_range(sampling.min_p, 0.0, 1.0):
        raise RequestError(f"min_p must be in [0, 1], got {sampling.min_p!r}", param="min_p")
    bias = sampling.logit_bias
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                           param="logit_bias")
    for pair in bias:
        if not isinstance(pair, tuple) or len(pair) != 2 or not is_int(pair[0], numpy=False) or not _in_range(pair[1], -100.0, 100.0):
            raise RequestError(f"logit_bias maps token ids (ints) to biases in [-100, 100], got {pair!r}",
                               param="logit_bias")
    if len({token for token, _ in bias}) != len(bias):
        raise RequestError("logit_bias names a token twice", param="logit_bias")


def check_choices(n, best_of) -> int:
    """The sequences a request of `n` choices out of `best_of` draws (`best_of` None: n); RequestError
    naming `n` or `best_of` outside `1 <= n <= best_of <= MAX_CHOICES`."""
    if not is_int(n, numpy=False) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n must be an int in [1, {MAX_CHOICES}], got {n!r}", param="n")
    if best_of is None:
        return n
    if not is_int(best_of, numpy=False) or not n <= best_of <= MAX_CHOICES:
        raise RequestError(f"best_of must be an int in [n={n}, {MAX_CHOICES}], got {best_of!r}", param="best_of")
    return best_of


def _check_logprobs(sampling) -> None:
    """`logprobs` and `prompt_logprobs` None or in [0, MAX_LOGPROBS]; `max_tokens` 0 (score the prompt, draw
    nothing) only with `prompt_logprobs`."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sampling, name)
        if value is not None and (not is_int(value, numpy=False) or not 0 <= value <= MAX_LOGPROBS):
            raise RequestError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}", param=name)
    if sampling.max_tokens == 0 and sampling.prompt_logprobs is None:
        raise RequestError("max_tokens must be >= 1; 0 (only score the prompt) needs prompt_logprobs",
                           param="max_tokens")


# -- a request against an engine --------------------------------------------------------------

def check_text(text: str, param: str = "prompt") -> None:
    """RequestError for an empty text prompt (a tokenizer that adds a BOS would make it one token)."""
    if not text:
        raise RequestError(f"{param} is empty", param=param)


def _prompt_ids(prompt_ids, vocab_size: int) -> tuple[int, ...]:
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"prompt_ids must be a non-empty sequence of ints, got {ids.dtype} {ids.shape}",
                           param="prompt")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
        raise RequestError(f"prompt_ids must be in [0, vocab_size={vocab_size}), got {bad} (range "
                           f"[{ids.min()}, {ids.max()}])", param="prompt")
    return tuple(ids.tolist())


def _max_tokens(prompt: int, asked: int | None, limits: RequestLimits) -> int:
    """`asked`, or for None the rest of the context; RequestError where prompt + output cannot fit."""
    context = limits.max_model_len
    if asked is None:
        if prompt >= context:
            raise RequestError(f"the prompt is {prompt} tokens; the context is max_model_len={context}: no room "
                               "for an answer", param="prompt", code=CONTEXT_LENGTH_EXCEEDED)
        asked = context - prompt
    elif prompt + asked > context:
        raise RequestError(f"the prompt ({prompt} tokens) plus max_tokens ({asked}) is more than the context, "
                           f"max_model_len={context}", param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED)
    if -(-(prompt + asked) // limits.page_size) > limits.num_pages:
        raise RequestError(f"the prompt ({prompt}) plus max_tokens ({asked}) needs more pages than the pool holds "
                           f"({limits.num_pages} of {limits.page_size} tokens)", param="max_tokens")
    return asked


def check_request(prompt_ids, sampling, limits: RequestLimits) -> tuple[tuple[int, ...], int]:
    """A request against an engine: `(prompt ids as a tuple of ints, max_tokens)`, max_tokens resolved
    (None: the rest of the context). RequestError for an empty prompt, ids outside the vocabulary, a
    prompt plus max_tokens past `max_model_len` or the pool, stop strings without a detokenizer, a guide
    without a guide compiler, or stop token ids outside the vocabulary (a guide's own text is checked
    when it compiles: `jaxattn.serving.structured`, also a RequestError). `sampling` was checked when it
    was built (`check_sampling`)."""
    ids = _prompt_ids(prompt_ids, limits.vocab_size)
    max_tokens = _max_tokens(len(ids), sampling.max_tokens, limits)
    if sampling.stop and not limits.detokenizer:
        raise RequestError("stop strings need the engine's detokenizer (Engine(..., detokenize=...))", param="stop")
    if sampling.guide is not None and not limits.guides:
        raise RequestError("this engine cannot constrain outputs: it was built without its tokenizer's "
                           "vocabulary (Engine(..., guide_compiler=...))", param="guide")
    bad = [t for t in sampling.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids must be in [0, vocab_size={limits.vocab_size}), got {bad}",
                           param="stop_token_ids")
    bad = [t for t, _ in sampling.logit_bias if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"logit_bias's token ids must be in [0, vocab_size={limits.vocab_size}), got {bad}",
                           param="logit_bias")
    if sampling.penalized and not limits.token_history:
        name = next(n for n in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                    if getattr(sampling, n) != (1.0 if n == "repetition_penalty" else 0.0))
        raise RequestError(f"{name} needs every token of the sequence, and this engine gives back the pages "
                           "behind its sliding window", param=name)
    return ids, max_tokens
