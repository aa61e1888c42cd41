"""Paged KV-cache bookkeeping: which pages (blocks) each sequence owns.

Pure Python, no torch. A pool of ``num_blocks`` pages, each holding
``block_size`` token slots. Every sequence (``int`` seq_id) owns a *block
table* (list of page ids, in position order) and a count of reserved slots
(``num_tokens``). Token position ``p`` of a sequence lives in page
``table[p // block_size]`` at offset ``p % block_size``; its flat slot id is
``page * block_size + offset``.

Target and draft models share the same block tables: each model keeps its own
KV tensors (:class:`specserve.kv_cache.KVCache`) addressed by the same page
ids, so a single ``BlockManager`` serves both.

Speculative decoding: reserve slots for the draft tokens with
:meth:`BlockManager.allocate`, then roll back rejected tokens with
:meth:`BlockManager.truncate` (rollback by length; the stale KV entries in the
kept partial page are simply overwritten later).

Automatic prefix caching (``enable_prefix_caching``; vLLM's design, exact keys): a full page whose
entries are final for every model is registered under its token chain, the key
``(key id of the page before, its block_size tokens + lookahead tokens)``. Keys hold the tokens
themselves, not a digest, so a hit is never a collision. ``lookahead`` is how many tokens past its
page a model's entry reads: 0 for a target or draft LLM, 1 for an EAGLE / MTP head, whose entry at
position p embeds token p+1. A new sequence adopts the longest chain of registered pages
(:meth:`BlockManager.match_prefix`, then :meth:`BlockManager.allocate` with the hit). Pages are
reference counted; a released registered page stays cached in the free pool in LRU order and is
evicted (its key dropped) only when a fresh page is needed and no never-cached page is left.
Registered pages lie wholly below every holder's computed tokens, and the engine writes only at
or after a sequence's computed tokens, so a shared page is never written (no copy-on-write needed).

A page is registered once the target's entries are final; it is also *draft-valid* once the
draft's / head's entries in it are. A proposer that reads the target's hidden states (a head) can
only start where its entries exist, so with ``require_draft_valid`` a hit stops at the first page
that is not draft-valid; a draft LLM catches up over the rest of a hit itself, rewriting the
draft entries nobody relies on (its entries are a function of the tokens, so what it writes is
what any other holder would).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["BlockManager", "NoFreeBlocksError", "PrefixHit", "PrefixValidity", "TargetOnly"]

_ROOT = -1   # the key id "before" a sequence's first page


class NoFreeBlocksError(RuntimeError):
    """The pool has too few free pages to serve an allocation.

    Raised by :meth:`BlockManager.allocate`; the manager's state is unchanged.
    """


@dataclass
class PrefixHit:
    """The registered pages a new sequence can adopt: ``pages`` (in position order) cover its first
    ``num_tokens`` tokens. Empty when nothing matched."""

    pages: list[int] = field(default_factory=list)
    block_size: int = 0
    num_draft_pages: int = 0   # leading pages whose draft / head entries are valid too

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.block_size

    @property
    def num_draft_tokens(self) -> int:
        return self.num_draft_pages * self.block_size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefixValidity(Protocol):
    """What the reuse of a sequence's pages depends on besides the target's entries (every
    :class:`~specserve.worker.base.Worker` has these members)."""

    kv_lookahead: int
    prefix_needs_draft: bool

    def num_valid_draft_tokens(self, seq_id: int, num_computed_tokens: int) -> int: ...


@dataclass(frozen=True)
class TargetOnly:
    """No proposer state: a page's entries are the target's; ``kv_lookahead`` tokens past the page
    may still be part of its key (tests and tools set it)."""

    kv_lookahead: int = 0
    prefix_needs_draft: bool = False

    def num_valid_draft_tokens(self, seq_id: int, num_computed_tokens: int) -> int:
        return num_computed_tokens


class BlockManager:
    """Free list + reference counts + per-sequence block tables (+ the prefix cache).

    Args:
        num_blocks: number of pages in the pool (>= 1).
        block_size: token slots per page (>= 1).
        enable_prefix_caching: register full pages by their token chain and reuse them.
        worker: what a page's reuse depends on beyond the target's entries (the engine's
            :class:`~specserve.worker.base.Worker`; default: the target alone). Read once here:
            ``kv_lookahead`` (tokens past its page that a page's entries depend on, see the module
            doc) and ``prefix_needs_draft`` (hits end at the first page whose draft entries are not
            valid: a head); asked when pages are published: ``num_valid_draft_tokens``.

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 worker: PrefixValidity | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks: int = int(num_blocks)
        self.block_size: int = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.worker = worker if worker is not None else TargetOnly()
        self.lookahead = int(self.worker.kv_lookahead)
        self.require_draft_valid = bool(self.worker.prefix_needs_draft)
        # allocate pops from the left, released pages are appended on the right
        self._free: deque[int] = deque(range(self.num_blocks))
        self._ref_counts: list[int] = [0] * self.num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        # prefix cache: key -> page; each registered page's key and key id; released registered
        # pages, least recently released first (evicted in that order); each sequence's chain ids
        self._cache: dict[tuple[int, tuple[int, ...]], int] = {}
        self._page_key: list[tuple[int, tuple[int, ...]] | None] = [None] * self.num_blocks
        self._page_key_id: list[int] = [_ROOT] * self.num_blocks
        self._draft_valid: list[bool] = [False] * self.num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._chain: dict[int, list[int]] = {}
        self._draft_marked: dict[int, int] = {}   # leading chain pages already marked draft-valid
        self._key_ids = itertools.count()
        self.num_queried_tokens = 0   # tokens of admitted sequences looked up, and those found (hit rate)
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ stats
    @property
    def num_free_blocks(self) -> int:
        """Number of pages no sequence holds (never-cached and evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Pages registered in the prefix cache (held or evictable)."""
        return len(self._cache)

    @property
    def usage(self) -> float:
        """Fraction of pages in use (held by at least one sequence), in [0, 1]."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def has_seq(self, seq_id: int) -> bool:
        """Whether ``seq_id`` currently has a block table."""
        return seq_id in self._tables

    def seq_ids(self) -> list[int]:
        """Ids of all sequences holding a block table."""
        return list(self._tables)

    def num_tokens(self, seq_id: int) -> int:
        """Slots reserved for ``seq_id``. Raises ``KeyError`` if unknown."""
        self._require(seq_id)
        return self._num_tokens[seq_id]

    def ref_count(self, page: int) -> int:
        """Number of block tables holding ``page``."""
        return self._ref_counts[page]

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of ``seq_id``'s block table (page ids in position order).

        Raises:
            KeyError: unknown ``seq_id``.
        """
        self._require(seq_id)
        return list(self._tables[seq_id])

    # ------------------------------------------------------------- planning
    def num_blocks_needed(self, seq_id: int | None, num_tokens: int, prefix: PrefixHit | None = None) -> int:
        """Pages taken from the free pool so that ``seq_id`` holds ``num_tokens`` slots in total.

        ``seq_id`` None or unknown means a new sequence, which adopts ``prefix``'s pages (those
        no one holds come out of the free pool too). Returns 0 if the sequence already covers
        ``num_tokens``.

        Raises:
            ValueError: ``num_tokens`` < 0.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if seq_id is not None and seq_id in self._tables:
            return max(0, _cdiv(num_tokens, self.block_size) - len(self._tables[seq_id]))
        pages = prefix.pages if prefix is not None else []
        idle = sum(1 for p in pages if self._ref_counts[p] == 0)
        return max(0, _cdiv(num_tokens, self.block_size) - len(pages)) + idle

    def can_allocate(self, seq_id: int | None, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Whether :meth:`allocate` of ``num_tokens`` total slots would succeed."""
        return self.num_blocks_needed(seq_id, num_tokens, prefix) <= self.num_free_blocks

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> PrefixHit:
        """The longest chain of registered pages that starts ``token_ids`` and covers at most
        ``max_tokens`` tokens (callers leave the last prompt token to compute, for its logits).
        Nothing is taken: :meth:`allocate` with the hit adopts the pages.
        """
        hit = PrefixHit(block_size=self.block_size)
        if not self.enable_prefix_caching:
            return hit
        bs, parent = self.block_size, _ROOT
        i = 0
        while (i + 1) * bs <= max_tokens and (i + 1) * bs + self.lookahead <= len(token_ids):
            page = self._cache.get((parent, tuple(token_ids[i * bs:(i + 1) * bs + self.lookahead])))
            if page is None or (self.require_draft_valid and not self._draft_valid[page]):
                break
            parent = self._page_key_id[page]
            hit.pages.append(page)
            if hit.num_draft_pages == i and self._draft_valid[page]:
                hit.num_draft_pages += 1
            i += 1
        return hit

    # ------------------------------------------------------------- mutation
    def allocate(self, seq_id: int, num_tokens: int, prefix: PrefixHit | None = None) -> list[int]:
        """Ensure ``seq_id``'s table covers ``num_tokens`` slots (new seq or growth).

        A new ``seq_id`` gets a table that starts with ``prefix``'s cached pages (shared: their
        reference counts go up) and continues with fresh ones (possibly empty if ``num_tokens``
        is 0). If the sequence already covers ``num_tokens`` slots nothing changes (allocate
        never shrinks; use :meth:`truncate`).

        Returns:
            The pages newly taken from the pool, in the order taken (adopted cached pages excluded).

        Raises:
            ValueError: ``num_tokens`` < 0, or a ``prefix`` for a sequence that already has a table,
                or one longer than ``num_tokens``.
            NoFreeBlocksError: too few free pages; no state is changed.
        """
        need = self.num_blocks_needed(seq_id, num_tokens, prefix)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"seq {seq_id}: need {need} free blocks for {num_tokens} tokens, "
                f"only {self.num_free_blocks} of {self.num_blocks} free"
            )
        new_pages: list[int] = []
        if seq_id not in self._tables:
            pages = prefix.pages if prefix is not None else []
            if len(pages) * self.block_size > num_tokens:
                raise ValueError(f"seq {seq_id}: a cached prefix of {len(pages)} pages is longer than "
                                 f"the {num_tokens} tokens allocated")
            for page in pages:
                if self._ref_counts[page] == 0:
                    del self._evictable[page]
                self._ref_counts[page] += 1
            self._tables[seq_id] = list(pages)
            self._num_tokens[seq_id] = 0
            self._chain[seq_id] = [self._page_key_id[p] for p in pages]
            self._draft_marked[seq_id] = prefix.num_draft_pages if prefix is not None else 0
        elif prefix is not None and prefix.pages:
            raise ValueError(f"seq {seq_id} already has a block table: a cached prefix is adopted only at its start")
        table = self._tables[seq_id]
        while len(table) < _cdiv(num_tokens, self.block_size):
            page = self._take()
            table.append(page)
            new_pages.append(page)
        if num_tokens > self._num_tokens[seq_id]:
            self._num_tokens[seq_id] = num_tokens
        return new_pages

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll ``seq_id`` back to ``num_tokens`` reserved slots.

        Pages wholly beyond ``num_tokens`` are released (ref count -1; back to
        the pool at 0). Used to discard rejected speculative tokens, which always lie past the
        sequence's cached pages (a cached page is final: rolling into it would let the sequence
        write into a page others may share).

        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: ``num_tokens`` < 0, greater than the slots reserved, or inside the
                sequence's cached pages.
        """
        self._require(seq_id)
        cur = self._num_tokens[seq_id]
        if num_tokens < 0 or num_tokens > cur:
            raise ValueError(
                f"seq {seq_id}: cannot truncate to {num_tokens} tokens (has {cur})"
            )
        cached = len(self._chain[seq_id]) * self.block_size
        if num_tokens < cached:
            raise ValueError(f"seq {seq_id}: cannot truncate to {num_tokens} tokens, inside its "
                             f"{cached} cached tokens")
        table = self._tables[seq_id]
        keep = _cdiv(num_tokens, self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        self._num_tokens[seq_id] = num_tokens

    def cache_full_pages(self, seq_id: int, token_ids: list[int], num_valid_tokens: int) -> int:
        """Register ``seq_id``'s full pages whose target entries are final: those wholly below
        ``num_valid_tokens`` (and with their ``lookahead`` tokens known in ``token_ids``, the
        sequence's tokens); mark those of its own pages wholly below the worker's
        ``num_valid_draft_tokens`` draft-valid. A page whose chain is already registered (another
        sequence computed the same tokens) is left unregistered; the chain goes on through that
        one. Returns the number of pages registered. No-op without prefix caching.

        Raises:
            KeyError: unknown ``seq_id``.
        """
        self._require(seq_id)
        if not self.enable_prefix_caching:
            return 0
        bs, table, chain = self.block_size, self._tables[seq_id], self._chain[seq_id]
        end = min(num_valid_tokens, self._num_tokens[seq_id], len(token_ids) - self.lookahead)
        draft_end = min(end, self.worker.num_valid_draft_tokens(seq_id, num_valid_tokens))
        marked = self._draft_marked[seq_id]
        for i in range(marked, min(draft_end // bs, len(chain))):   # adopted or registered before, now covered
            if self._page_key_id[table[i]] == chain[i]:
                self._draft_valid[table[i]] = True
        self._draft_marked[seq_id] = max(marked, min(draft_end // bs, len(chain)))
        registered = 0
        for i in range(len(chain), end // bs):
            key = (chain[-1] if chain else _ROOT, tuple(token_ids[i * bs:(i + 1) * bs + self.lookahead]))
            page = self._cache.get(key)
            if page is None:
                page = table[i]
                self._cache[key] = page
                self._page_key[page] = key
                self._page_key_id[page] = next(self._key_ids)
                self._draft_valid[page] = (i + 1) * bs <= draft_end
                registered += 1
            chain.append(self._page_key_id[page])
        return registered

    def num_cached_pages(self, seq_id: int) -> int:
        """How many of ``seq_id``'s first pages are in a registered chain (adopted or registered)."""
        self._require(seq_id)
        return len(self._chain[seq_id])

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id`` and release every page it holds (finish or abort).

        Raises:
            KeyError: unknown ``seq_id`` (message names it).
        """
        self._require(seq_id)
        table = self._tables.pop(seq_id)
        del self._num_tokens[seq_id]
        del self._chain[seq_id]
        del self._draft_marked[seq_id]
        # the tail first: a cached prefix's tail pages are the least likely to be shared again
        for page in reversed(table):
            self._release(page)

    # --------------------------------------------------------------- lookup
    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slot ids (``page * block_size + offset``) of positions ``[start, end)``.

        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: unless ``0 <= start <= end <= num_tokens(seq_id)``.
        """
        self._require(seq_id)
        n = self._num_tokens[seq_id]
        if not 0 <= start <= end <= n:
            raise ValueError(
                f"seq {seq_id}: bad slot range [{start}, {end}) for {n} reserved tokens"
            )
        bs = self.block_size
        table = self._tables[seq_id]
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ------------------------------------------------------------ internals
    def _require(self, seq_id: int) -> None:
        if seq_id not in self._tables:
            raise KeyError(f"unknown seq_id {seq_id!r}")

    def _take(self) -> int:
        """A page for new entries: a never-cached one, else the least recently released cached
        page, whose key is dropped (eviction)."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._cache[self._page_key[page]]
            self._page_key[page], self._page_key_id[page] = None, _ROOT
            self._draft_valid[page] = False
        self._ref_counts[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._ref_counts[page] -= 1
        if self._ref_counts[page] == 0:
            if self._page_key[page] is not None:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def reset_prefix_cache(self) -> int:
        """Drop every key (held pages keep their entries, unshared from now on; cached free pages
        become plain free pages). Returns the number of keys dropped."""
        n = len(self._cache)
        for page in self._evictable:
            self._free.append(page)
        self._evictable.clear()
        for key, page in self._cache.items():
            self._page_key[page], self._page_key_id[page] = None, _ROOT
            self._draft_valid[page] = False
        self._cache.clear()
        for chain in self._chain.values():
            chain.clear()
        for seq_id in self._draft_marked:
            self._draft_marked[seq_id] = 0
        return n

    def is_draft_valid(self, page: int) -> bool:
        """Whether registered ``page``'s draft / head entries are valid (reusable by a proposer)."""
        return self._draft_valid[page]

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent.

        Checks: the free list has no duplicates and only valid page ids; no
        page is both free and owned; each page's ref count equals the number of
        tables holding it; free + owned pages == all pages; no table holds a
        page twice; each table has exactly ``ceil(num_tokens / block_size)``
        pages. Prefix cache: evictable pages are free and keyed, plain free pages are not, every
        key maps to the page that holds it, and no sequence's cached chain runs past its tokens.

        Raises:
            AssertionError: on the first violated invariant.
        """
        free = list(self._free) + list(self._evictable)
        free_set = set(free)
        assert len(free_set) == len(free), "duplicate page in free list"
        assert all(0 <= p < self.num_blocks for p in free), "bad page id in free list"
        counts = [0] * self.num_blocks
        for sid, table in self._tables.items():
            assert len(set(table)) == len(table), f"seq {sid} holds a page twice"
            assert len(table) == _cdiv(self._num_tokens[sid], self.block_size), (
                f"seq {sid}: {len(table)} pages for {self._num_tokens[sid]} tokens"
            )
            for p in table:
                assert 0 <= p < self.num_blocks, f"seq {sid}: bad page id {p}"
                counts[p] += 1
        owned = {p for p in range(self.num_blocks) if counts[p] > 0}
        assert not (owned & free_set), f"pages both free and owned: {owned & free_set}"
        assert counts == self._ref_counts, "ref counts disagree with block tables"
        assert len(owned) + len(free_set) == self.num_blocks, "pages lost from pool"
        assert set(self._tables) == set(self._num_tokens) == set(self._chain), "table/num_tokens key mismatch"
        for page in self._evictable:
            assert self._page_key[page] is not None, f"evictable page {page} has no key"
        for page in self._free:
            assert self._page_key[page] is None, f"free page {page} still has a key"
        for key, page in self._cache.items():
            assert self._page_key[page] == key, f"page {page} is cached under another key"
        assert sum(k is not None for k in self._page_key) == len(self._cache), "keys without cache entries"
        assert all(self._page_key[p] is not None for p in range(self.num_blocks) if self._draft_valid[p]), (
            "a draft-valid page without a key")
        for sid, chain in self._chain.items():
            assert len(chain) * self.block_size <= self._num_tokens[sid], (
                f"seq {sid}: {len(chain)} cached pages past its {self._num_tokens[sid]} tokens")
