"""Each request's pages: taken on admission, one more for each page its tokens reach, keyed when full,
given back behind a sliding window, released when it ends.

`KVCacheManager` is the only writer of a request's page bookkeeping (`Request.pages`, `num_computed`,
`page_keys`, `num_cached_tokens`); the pool it draws from is `jaxattn.serving.pages.PageAllocator`
(free list, refcounts, the prefix cache's least recently used pages). It decides nothing about who
runs: the scheduler asks it whether pages can be had and, when they cannot, preempts.

* Admission (`allocate_prompt`): the prompt's full pages, but the last token's, looked up by their hash
  chain (`page_keys`): those found are shared, the rest allocated; all or nothing. A request asking for
  prompt log-probabilities looks nothing up (each of its prompt tokens must be computed, to be scored).
  The chain starts from the request's `cache_root`: b"" for the base, its adapter's own key for a
  request run with a LoRA adapter (`jaxattn.serving.loras`), whose keys and values are not the base's.
* Decoding (`needs_page`, `append_page`): a page for slot `num_computed` once the last one is full.
* Several decode steps in one call (`reserve`): the pages of the call's slots ahead, as many as can be
  had without preempting anyone.
* After a step (`computed`): pages that are now full are keyed for later prompts; in a model whose
  every layer has a sliding window, pages no query can see again are given back (-1 in the table).
* `free`: every page back to the pool (a request that ended, or was preempted).

vLLM V1's KVCacheManager is the model (read for its shape).
"""

from __future__ import annotations

import collections

from jaxattn.config import ModelConfig
from jaxattn.serving.pages import PageAllocator, page_keys
from jaxattn.serving.requests import Request


def local_window(config: ModelConfig) -> int | None:
    """The widest window when every layer is local (its pages before it can be given back), else None."""
    windows = [config.layer_attention(i).window for i in range(config.num_layers)]
    return None if any(w is None for w in windows) else max(windows)


class KVCacheManager:
    """The pages of every running request (see the module docstring).

    Args:
      num_pages, page_size: the pool.
      prefix_caching: share full prompt pages between requests.
      window: the widest sliding window when every layer has one (`local_window`), else None.
      stats: the engine's counters (`prefix_hit_tokens`, `pages_past_window` are counted here).
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool, window: int | None,
                 stats: collections.Counter):
        self.allocator = PageAllocator(num_pages, page_size, prefix_caching=prefix_caching)
        self.page_size, self.window, self.stats = page_size, window, stats

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def available(self) -> int:
        """Pages that can be had now (free or evictable from the prefix cache)."""
        return self.allocator.available

    # -- admission ----------------------------------------------------------------------------

    def allocate_prompt(self, request: Request) -> bool:
        """Pages for every token of a request being admitted: the prefix cache's hits shared, the rest
        allocated; its first `num_computed` tokens are those the hits hold. False (nothing taken, the
        lookup not counted) when the pages cannot all be had now."""
        tokens = request.tokens
        # Shared pages: full pages of every token but the last (at least one is computed, to draw from).
        # None for a request that scores its prompt: a token found in the cache would never be computed.
        scores = request.sampling.prompt_logprobs is not None
        keys = [] if scores else page_keys(tokens[:-1], self.page_size, request.cache_root)
        hits = self.allocator.lookup(keys)
        needed = -(-len(tokens) // self.page_size) - len(hits)
        if needed > self.allocator.available:
            self.allocator.release(hits)
            self.allocator.hits -= len(hits)
            self.allocator.queries -= len(keys)
            return False
        request.pages = hits + self.allocator.allocate(needed)
        request.page_keys = keys[:len(hits)]
        request.num_computed = request.num_cached_tokens = len(hits) * self.page_size
        self.stats["prefix_hit_tokens"] += request.num_cached_tokens
        return True

    # -- decoding -----------------------------------------------------------------------------

    def needs_page(self, request: Request) -> bool:
        """Slot `num_computed` (the next token's) lies past the request's pages."""
        return request.num_computed // self.page_size >= len(request.pages)

    def append_page(self, request: Request) -> None:
        """One more page for the request (the caller made sure one is `available`)."""
        request.pages += self.allocator.allocate(1)

    def reserve(self, request: Request, count: int) -> int:
        """Pages for slots `num_computed ... num_computed + count - 1` (the first already held), taken while
        free ones last -> how many of those slots the request's pages now hold (1 to `count`)."""
        wanted = -(-(request.num_computed + count) // self.page_size) - len(request.pages)
        taken = min(max(wanted, 0), self.allocator.available)
        if taken:
            request.pages += self.allocator.allocate(taken)
        return min(count, len(request.pages) * self.page_size - request.num_computed)

    # -- after a step -------------------------------------------------------------------------

    def computed(self, request: Request, count: int) -> None:
        """`count` more tokens of the request are in its pages: key the pages that are now full and,
        past a sliding window everything has, give back the pages no query can see again."""
        request.num_computed += count
        full = request.num_computed // self.page_size
        if full > len(request.page_keys):
            self._key_full_pages(request, full)
        if self.window is not None:
            self._give_back_behind_window(request)

    def _key_full_pages(self, request: Request, full: int) -> None:
        parent = request.page_keys[-1] if request.page_keys else request.cache_root
        start = len(request.page_keys) * self.page_size
        new = page_keys(request.tokens[start:full * self.page_size], self.page_size, parent)
        for index, key in enumerate(new, start=len(request.page_keys)):
            if request.pages[index] >= 0:
                self.allocator.register(request.pages[index], key)
        request.page_keys += new

    def _give_back_behind_window(self, request: Request) -> None:
        lowest_visible = request.num_computed - self.window + 1  # of the next query, at num_computed
        for index in range(max(lowest_visible, 0) // self.page_size):
            if request.pages[index] >= 0:
                self.allocator.release([request.pages[index]])
                request.pages[index] = -1
                self.stats["pages_past_window"] += 1

    # -- the end ------------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Every page of the request back to the pool (keyed ones stay in the prefix cache)."""
        self.allocator.release([p for p in request.pages if p >= 0])
        request.pages, request.page_keys, request.num_computed = [], [], 0

    def tokens_held(self, requests) -> int:
        """Tokens whose keys and values the requests' pages hold (pages given back not counted)."""
        return sum(r.num_computed - (sum(p < 0 for p in r.pages) * self.page_size) for r in requests)
