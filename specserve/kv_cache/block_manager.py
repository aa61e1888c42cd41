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

Reference counts: every page records how many tables hold it and goes back to the pool at 0.
Today each page has one holder; prefix caching (pages shared by their token chain, never written
while shared) is what will give a page several.
"""

from __future__ import annotations

from collections import deque

__all__ = ["BlockManager", "NoFreeBlocksError"]


class NoFreeBlocksError(RuntimeError):
    """The pool has too few free pages to serve an allocation.

    Raised by :meth:`BlockManager.allocate`; the manager's state is unchanged.
    """


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list + reference counts + per-sequence block tables.

    Args:
        num_blocks: number of pages in the pool (>= 1).
        block_size: token slots per page (>= 1).

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is < 1.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks: int = int(num_blocks)
        self.block_size: int = int(block_size)
        # allocate pops from the left, released pages are appended on the right
        self._free: deque[int] = deque(range(self.num_blocks))
        self._ref_counts: list[int] = [0] * self.num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}

    # ------------------------------------------------------------------ stats
    @property
    def num_free_blocks(self) -> int:
        """Number of pages currently in the free pool."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of pages in use (owned by at least one sequence), in [0, 1]."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

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
    def num_blocks_needed(self, seq_id: int | None, num_tokens: int) -> int:
        """Extra pages needed so that ``seq_id`` holds ``num_tokens`` slots in total.

        ``seq_id`` None or unknown means a new sequence. Returns 0 if the
        sequence already covers ``num_tokens``.

        Raises:
            ValueError: ``num_tokens`` < 0.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        have = len(self._tables.get(seq_id, ())) if seq_id is not None else 0
        return max(0, _cdiv(num_tokens, self.block_size) - have)

    def can_allocate(self, seq_id: int | None, num_tokens: int) -> bool:
        """Whether :meth:`allocate` of ``num_tokens`` total slots would succeed."""
        return self.num_blocks_needed(seq_id, num_tokens) <= len(self._free)

    # ------------------------------------------------------------- mutation
    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Ensure ``seq_id``'s table covers ``num_tokens`` slots (new seq or growth).

        A new ``seq_id`` gets a fresh table (possibly empty if ``num_tokens``
        is 0). If the sequence already covers ``num_tokens`` slots nothing
        changes (allocate never shrinks; use :meth:`truncate`).

        Returns:
            The pages newly taken from the pool, in the order taken.

        Raises:
            ValueError: ``num_tokens`` < 0.
            NoFreeBlocksError: too few free pages; no state is changed.
        """
        need = self.num_blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocksError(
                f"seq {seq_id}: need {need} free blocks for {num_tokens} tokens, "
                f"only {len(self._free)} of {self.num_blocks} free"
            )
        new_pages: list[int] = []
        if seq_id not in self._tables:
            self._tables[seq_id] = []
            self._num_tokens[seq_id] = 0
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
        the pool at 0). Used to discard rejected speculative tokens.

        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: ``num_tokens`` < 0 or greater than the slots reserved.
        """
        self._require(seq_id)
        cur = self._num_tokens[seq_id]
        if num_tokens < 0 or num_tokens > cur:
            raise ValueError(
                f"seq {seq_id}: cannot truncate to {num_tokens} tokens (has {cur})"
            )
        table = self._tables[seq_id]
        keep = _cdiv(num_tokens, self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        self._num_tokens[seq_id] = num_tokens

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id`` and release every page it holds (finish or abort).

        Raises:
            KeyError: unknown ``seq_id`` (message names it).
        """
        self._require(seq_id)
        table = self._tables.pop(seq_id)
        del self._num_tokens[seq_id]
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
        page = self._free.popleft()
        self._ref_counts[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._ref_counts[page] -= 1
        if self._ref_counts[page] == 0:
            self._free.append(page)

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent.

        Checks: the free list has no duplicates and only valid page ids; no
        page is both free and owned; each page's ref count equals the number of
        tables holding it; free + owned pages == all pages; no table holds a
        page twice; each table has exactly ``ceil(num_tokens / block_size)``
        pages.

        Raises:
            AssertionError: on the first violated invariant.
        """
        free = list(self._free)
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
        assert set(self._tables) == set(self._num_tokens), "table/num_tokens key mismatch"
