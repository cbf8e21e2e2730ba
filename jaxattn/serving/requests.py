"""A request's sampling settings, its state in the engine, and what it streams out (tokens, text and,
when asked, their log-probabilities)."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Callable, NamedTuple

from jaxattn.serving.guides import Guide
from jaxattn.serving.text import TextStream
from jaxattn.serving.validation import check_sampling

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens.

    Attributes:
      temperature: 0 = greedy; else the softmax temperature (>= 0).
      top_k: keep the k most likely tokens; 0 = off.
      top_p: keep the smallest most likely set of mass >= top_p, in (0, 1]; 1 = off.
      seed: the draws' seed: a seeded request's tokens depend on its seed and positions only,
        never on what else runs. None: drawn from the engine's own generator.
      max_tokens: the most new tokens (>= 1); None: up to the context (`max_model_len` less the prompt,
        resolved by the engine when the request is added); 0: draw nothing, only score the prompt
        (needs `prompt_logprobs`).
      stop_token_ids: tokens that end the request (in `output_ids`, never in the streamed text).
      stop: strings that end the request (needs the engine's detokenizer); the text stops
        before the first one.
      guide: what the output must match (`jaxattn.serving.guides.Guide`: a JSON schema, a regex, a
        choice, a grammar); None: anything.
      logprobs: None: off; k in [0, 20]: each drawn token's log-probability and the k most likely
        tokens' (`Request.output_logprobs`, `output_top_logprobs`). The model's raw log-softmax in
        float32, before temperature or any filter (vLLM's default).
      prompt_logprobs: None: off; k in [0, 20]: each prompt token's log-probability given the tokens
        before it, and the k most likely there (`Request.prompt_logprobs`, `prompt_top_logprobs`;
        the first token's are None). Such a request skips the prefix cache: every token is computed.
      presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: `logits[j] -= c[j] * frequency_penalty
        + (c[j] > 0) * presence_penalty`, `c[j]` the count of token j among the tokens drawn so far.
      repetition_penalty: transformers' and vLLM's, > 0 (1 = off): a token in the prompt or drawn so far
        has a positive logit divided by it, a negative one multiplied.
      min_p: in [0, 1] (0 = off): after the temperature, tokens of probability < min_p times the most
        likely token's are dropped.
      logit_bias: token id -> bias in [-100, 100], added to the logits (a dict, or pairs; kept as
        pairs; at most `validation.MAX_LOGIT_BIAS`).
      lora: the name of a LoRA adapter the engine holds (`Engine.add_lora`), run with the base for this
        request alone; None: the base.
    The order on the device is vLLM's: bias, penalties, temperature, min_p, top-k, top-p
    (`jaxattn.serving.logit_knobs`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    guide: Guide | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    lora: str | None = None

    def __post_init__(self):
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(tuple(p) if isinstance(p, (tuple, list)) else p for p in bias))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise TypeError(f"guide must be a jaxattn.serving.guides.Guide or None, got {type(self.guide).__name__}")
        check_sampling(self)  # each field in its range (a RequestError, a ValueError, naming the field)

    @property
    def penalized(self) -> bool:
        """Some penalty is on (the step reads the sequence's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


TopLogprobs = tuple[tuple[int, float], ...]  # (token id, log-probability), the most likely first


class StepLogprobs(NamedTuple):
    """What a step gives a row that asks: the drawn token's log-probability and the top ones (all
    `MAX_LOGPROBS`; the request keeps its own k)."""

    logprob: float
    top: TopLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One request: its prompt, its draws so far, and its place in the engine.

    What streams out: `output_ids` grows by one token per step that draws for it, with `token_times`
    (`time.perf_counter()` per token); `take_new()` returns the tokens (and text, with a detokenizer)
    since the last call. With `sampling.logprobs`, `output_logprobs` (a plain float per output token)
    and `output_top_logprobs` (its k most likely `(id, logprob)`) grow with them; with
    `sampling.prompt_logprobs`, `prompt_logprobs` and `prompt_top_logprobs` hold one entry per prompt
    token (None for the first), complete once the prompt is computed. `finished` and `finish_reason`
    ("stop", "length", "error" or "cancelled") say when and why it ended, `error` why an "error"; a
    guided request stops when its guide is complete.
    """

    def __init__(self, prompt_ids: tuple[int, ...], sampling: SamplingParams, seed: int,
                 detokenize: Callable[[list[int]], str] | None):
        self.id = next(_ids)
        self.prompt_ids, self.sampling, self.seed = prompt_ids, sampling, seed
        self.arrival_time = time.perf_counter()
        self.output_ids: list[int] = []
        self.token_times: list[float] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[TopLogprobs] = []
        scored = len(prompt_ids) if sampling.prompt_logprobs is not None else 0
        self.prompt_logprobs: list[float | None] = [None] * scored
        self.prompt_top_logprobs: list[TopLogprobs | None] = [None] * scored
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended with "error"
        self.text = TextStream(detokenize, sampling.stop) if detokenize is not None else None
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0  # the drawn tokens' raw log-probabilities summed (when computed)
        self.wants_logprob = False  # set for the sequences of a best_of request, ranked by it
        self.leader: Request | None = None  # a sibling of n choices waits until it has computed the prompt
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache (last admission)
        # Its guide's state (`jaxattn.serving.structured.GuideState`), set by the engine for a guided
        # request: the model runner reads its mask, the scheduler advances it by each token drawn.
        self.guide_state = None
        self._taken = 0
        # The KV-cache manager's bookkeeping (`jaxattn.serving.kv_cache_manager`, its only writer): pages
        # held (block table; -1 for pages given back past a window), tokens whose keys and values are in
        # them, the hash-chain keys of its full computed pages. Kept here, not in a table by request id,
        # so a step reads them without a lookup.
        self.pages: list[int] = []
        self.num_computed = 0
        self.page_keys: list[bytes] = []
        # Its adapter's (`sampling.lora`): the slot it holds while it runs (-1: none, the base), set on each
        # admission, and the key its first page's key chains from (b"": the base's; `jaxattn.serving.loras`).
        self.lora_slot = -1
        self.cache_root = b""
        # How many tokens it drafts per step with speculative decoding (`jaxattn.serving.speculation`).
        self.draft_schedule = None
        self.draft_row = None  # the proposer's row it holds (a draft model's cache row)

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far: what the cache must hold to draw the next token."""
        return list(self.prompt_ids) + self.output_ids

    def token_at(self, position: int) -> int:
        """`tokens[position]` without making the list."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[position] if position < prompt else self.output_ids[position - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def add_token(self, token: int, now: float, logprobs: StepLogprobs | None = None) -> None:
        """Appends a drawn token (and, when the request asks, its log-probabilities, the top cut to its k)."""
        self.output_ids.append(token)
        self.token_times.append(now)
        if logprobs is not None:  # asked for, or a best_of sequence (`wants_logprob`), ranked by the sum
            self.cumulative_logprob += logprobs.logprob
        if self.sampling.logprobs is not None and logprobs is not None:
            self.output_logprobs.append(logprobs.logprob)
            self.output_top_logprobs.append(logprobs.top[:self.sampling.logprobs])

    def score_prompt(self, position: int, logprobs: StepLogprobs) -> None:
        """Prompt token `position`'s log-probability given those before it (the top cut to its k)."""
        self.prompt_logprobs[position] = logprobs.logprob
        self.prompt_top_logprobs[position] = logprobs.top[:self.sampling.prompt_logprobs]

    def take_new(self) -> tuple[list[int], str]:
        """The tokens drawn since the last call, and the text they complete (whole characters only;
        "" without a detokenizer)."""
        new = self.output_ids[self._taken:]
        self._taken = len(self.output_ids)
        return new, (self.text.take() if self.text is not None else "")

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, prompt={len(self.prompt_ids)} tokens, output={len(self.output_ids)}, "
                f"{self.status.value}{'' if self.finish_reason is None else ': ' + self.finish_reason})")
