"""The page allocator of a paged KV cache: a free list, refcounts, and prefix caching.

Every page of the pool is in exactly one of three states:

* free: on `_free`, holding nothing anyone wants;
* in use: `refcount > 0`, listed in the block table of that many running sequences;
* cached: `refcount == 0` but its tokens' hash is known (`_cached`, least recently used first):
  a full page some finished or preempted sequence computed, kept for a later prompt that
  starts with the same tokens, and evicted (its hash forgotten) only when a page is needed
  and none is free.

Prefix caching keys a full page by the hash chain of its tokens: the page holding tokens
`[i*ps, (i+1)*ps)` is keyed by `sha256(key of page i-1, its ps token ids)`, so equal keys mean
equal tokens from the start of the sequence, hence (the cache is exact, docs/theory.md §9)
equal keys and values in every layer. Only full pages are keyed; a page being written is
never shared. vLLM's block manager is the model (read for its data structures).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def page_keys(tokens, page_size: int, parent: bytes = b"") -> list[bytes]:
    """The hash-chain keys of the full pages of `tokens` (a sequence from its start)."""
    keys, ids = [], np.asarray(tokens, np.int64)
    for start in range(0, len(ids) - page_size + 1, page_size):
        parent = hashlib.sha256(parent + ids[start:start + page_size].tobytes()).digest()
        keys.append(parent)
    return keys


class PageAllocator:
    """Pages `0 .. num_pages - 1` of one pool, shared by every sequence (and every layer: a
    sequence's block table names the same page in each layer's pool).

    Attributes:
      num_pages: the pool's pages.
      page_size: slots per page.
      prefix_caching: keep full pages by their keys for later prompts (else freed at once).
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True):
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self._free = collections.deque(range(num_pages))
        self._refcount = np.zeros(num_pages, np.int64)
        self._key_of: dict[int, bytes] = {}  # page -> key, for keyed pages (in use or cached)
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # refcount 0, LRU first
        self.hits = 0  # pages found in the prefix cache
        self.queries = 0  # full prompt pages looked up

    # -- counts ---------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Pages that can be had now: free ones and cached ones (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def in_use(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.available

    @property
    def cached(self) -> int:
        """Pages kept for the prefix cache that no sequence holds."""
        return len(self._cached)

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """`count` pages for one sequence (refcount 1 each): free pages first, then the least
        recently used cached ones, their keys forgotten. The caller checks `available` first."""
        if count > self.available:
            raise RuntimeError(f"asked for {count} pages, {self.available} available")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def release(self, pages) -> None:
        """Drops one reference to each page; a page nobody holds is cached (if keyed) or freed.
        Pages are released last first, so the deepest pages of a chain are evicted first."""
        for page in reversed(list(pages)):
            if self._refcount[page] <= 0:
                raise RuntimeError(f"page {page} released more often than it was held")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    # -- prefix caching ---------------------------------------------------------------------

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Takes a reference to the longest run of pages, from the first, whose keys are known;
        returns them (the caller's first `len(result)` pages)."""
        found = []
        for key in keys:
            page = self._page_of.get(key) if self.prefix_caching else None
            if page is None:
                break
            if self._refcount[page] == 0:
                del self._cached[page]
            self._refcount[page] += 1
            found.append(page)
        self.queries += len(keys)
        self.hits += len(found)
        return found

    def register(self, page: int, key: bytes) -> None:
        """Records that `page` (held, full) holds the tokens `key` names. A key already held by
        another page is left with that page (this one stays unkeyed, freed when released)."""
        if self.prefix_caching and key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def check_all_free(self) -> None:
        """AssertionError unless no sequence holds any page (after every request ended): no leak."""
        held = np.flatnonzero(self._refcount)
        assert held.size == 0, f"pages still held: {held.tolist()}"
        assert self.available == self.num_pages, f"{self.num_pages - self.available} pages unaccounted for"
