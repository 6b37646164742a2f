"""The paged KV pool's bookkeeping: which pages are free, who holds each, and which hold a
prompt prefix another request can reuse.

A page is ``P`` slots on every rank of a DCP group of D ranks, so one logical page holds
``P x D`` consecutive token positions of a sequence (each rank its 1/D of them, by the KV
layout), and the page table of a sequence is the same on every rank.  The pool of N
tokens (the whole group's capacity) is ``N / (P x D)`` pages.

This module owns no tensor.  It hands out page numbers, counts references, and keeps the
prefix index: a whole logical page of a prompt is keyed by its tokens and every token
before them (a hash chain), so two prompts that share a prefix share its pages.  A page
no request holds stays in the index, evictable least recently used first, until an
allocation needs it.  Every rank builds the same pool and makes the same calls, so every
rank hands out the same pages.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


DEFAULT_PAGE_SIZE = 64
"""Slots a page holds on each rank where a pool is the default (``serve`` on CUDA): the
paged step was measured within 3% of rows with pages of 64 (BENCHMARKS.md)."""


@dataclass(frozen=True)
class PoolShape:
    page_size: int
    """P: slots a page holds on each rank."""
    dcp_size: int
    """D: ranks of the DCP group; a logical page spans P x D token positions."""
    kv_tokens: int
    """N: the group's capacity in tokens (each rank holds N / D of them)."""

    def __post_init__(self) -> None:
        for name in ("page_size", "dcp_size", "kv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.kv_tokens < self.page_tokens:
            raise ValueError(
                f"kv_tokens={self.kv_tokens} is less than one page of {self.page_tokens} tokens (page_size "
                f"{self.page_size} x DCP size {self.dcp_size}); give the pool at least one page")

    @property
    def page_tokens(self) -> int:
        """Token positions of one logical page: P x D."""
        return self.page_size * self.dcp_size

    @property
    def pages(self) -> int:
        return self.kv_tokens // self.page_tokens

    def pages_for(self, tokens: int) -> int:
        """Pages a sequence of ``tokens`` positions needs."""
        return -(-tokens // self.page_tokens)


def prefix_keys(tokens: Sequence[int], page_tokens: int) -> list[bytes]:
    """One key per whole page of ``tokens`` that another token follows: a digest of the
    page's tokens, the token after them and the key of the page before, so a key names
    the whole prefix up to the page's end and the token that comes next.  That token is in
    the key because an EAGLE draft's keys at a position read the token one ahead: the
    draft's keys at a page's last position are only right for the token that follows."""
    keys, previous = [], b""
    packed = struct.pack(f"<{len(tokens)}q", *tokens)  # 8 bytes a token, packed once for every page
    for start in range(0, len(tokens) - page_tokens, page_tokens):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(packed[8 * start : 8 * (start + page_tokens + 1)])
        previous = digest.digest()
        keys.append(previous)
    return keys


class PagePool:
    """Free pages, reference counts and the prefix index of one pool."""

    def __init__(self, shape: PoolShape):
        self.shape = shape
        self._free = list(range(shape.pages - 1, -1, -1))  # popped from the end: page 0 first
        self._references = [0] * shape.pages
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages no one holds, oldest first

    @property
    def available(self) -> int:
        """Pages an allocation can take now: the free ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Pages some request holds."""
        return self.shape.pages - self.available

    def references(self, page: int) -> int:
        return self._references[page]

    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages for one holder (reference count 1 each), evicting cached pages
        no one holds, least recently used first; ``None`` if the pool has not that many."""
        if count > self.available:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._references[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page: a page no one holds is free again, or, if it
        holds an indexed prefix, evictable (most recently used last)."""
        for page in pages:
            if self._references[page] < 1:
                raise ValueError(f"page {page} is released more often than it was taken")
            self._references[page] -= 1
            if self._references[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def match(self, tokens: Sequence[int], granularity: int = 1) -> list[int]:
        """The cached pages of the longest indexed prefix of ``tokens``, cut to a multiple of
        ``granularity`` pages, each taken with one more reference.  Whole pages only, each
        followed by a token of ``tokens``: never the page holding the last token, whose
        logits the request must compute."""
        pages = []
        for key in prefix_keys(tokens, self.shape.page_tokens):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        pages = pages[: len(pages) // granularity * granularity]
        for page in pages:
            if self._references[page] == 0:
                del self._evictable[page]
            self._references[page] += 1
        return pages

    def publish(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Index the whole pages of ``tokens`` (a prompt whose keys and values ``pages`` now
        hold, in order) for later requests; returns the indices (into ``pages``) of those it
        indexed.  A prefix already indexed keeps its first page."""
        indexed = []
        for index, (key, page) in enumerate(zip(prefix_keys(tokens, self.shape.page_tokens), pages)):
            if key in self._page_of or page in self._key_of:
                continue
            self._page_of[key], self._key_of[page] = page, key
            indexed.append(index)
        return indexed
