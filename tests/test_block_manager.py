"""Tests for specserve.kv_cache.block_manager.BlockManager."""

from __future__ import annotations


import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specserve.kv_cache.block_manager import BlockManager, NoFreeBlocksError


# --------------------------------------------------------------------- hand cases
def test_module_does_not_import_torch_itself():
    import specserve.kv_cache.block_manager as bm_mod

    src = open(bm_mod.__file__).read()
    assert "import torch" not in src
    assert "torch" not in vars(bm_mod)


def test_17_tokens_two_pages_then_truncate_to_16():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.num_blocks_needed(None, 17) == 2
    assert bm.allocate(0, 17) == [0, 1]
    assert bm.block_table(0) == [0, 1]
    assert bm.num_free_blocks == 2
    assert bm.usage == 0.5
    bm.truncate(0, 16)
    assert bm.block_table(0) == [0]
    assert bm.num_tokens(0) == 16
    assert bm.num_free_blocks == 3
    bm.check_invariants()


def test_slot_mapping_hand_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 3)  # page 0
    bm.allocate(2, 5)  # pages 1, 2
    bm.allocate(1, 6)  # page 3 appended
    assert bm.block_table(1) == [0, 3]
    assert bm.block_table(2) == [1, 2]
    # seq 1: positions 0..5 -> page 0 offsets 0..3, page 3 offsets 0..1
    assert bm.slot_mapping(1, 0, 6) == [0, 1, 2, 3, 12, 13]
    assert bm.slot_mapping(1, 2, 5) == [2, 3, 12]
    # seq 2: page 1 -> slots 4..7, page 2 -> slot 8
    assert bm.slot_mapping(2, 0, 5) == [4, 5, 6, 7, 8]
    assert bm.slot_mapping(2, 3, 3) == []
    with pytest.raises(ValueError):
        bm.slot_mapping(2, 0, 6)
    with pytest.raises(ValueError):
        bm.slot_mapping(2, 3, 2)
    with pytest.raises(KeyError):
        bm.slot_mapping(99, 0, 0)


def test_block_size_one():
    bm = BlockManager(num_blocks=3, block_size=1)
    assert bm.allocate(5, 3) == [0, 1, 2]
    assert bm.slot_mapping(5, 0, 3) == [0, 1, 2]
    assert not bm.can_allocate(6, 1)
    bm.truncate(5, 1)
    assert bm.num_free_blocks == 2


def test_free_list_order_fifo():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(0, 2)  # page 0
    bm.allocate(1, 2)  # page 1
    bm.free(0)  # page 0 to the back: free = [2, 3, 0]
    assert bm.allocate(2, 6) == [2, 3, 0]


def test_grow_is_noop_when_covered_and_never_shrinks():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 6)
    assert bm.allocate(0, 7) == []
    assert bm.allocate(0, 3) == []
    assert bm.num_tokens(0) == 7
    assert bm.block_table(0) == [0, 1]


def test_allocate_failure_has_no_side_effects():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate(0, 5)
    before = (bm.block_table(0), bm.num_free_blocks, list(bm._free))
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(0, 13)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, 9)
    assert issubclass(NoFreeBlocksError, RuntimeError)
    assert (bm.block_table(0), bm.num_free_blocks, list(bm._free)) == before
    assert bm.num_tokens(0) == 5
    assert not bm.has_seq(1)
    bm.check_invariants()


def test_allocate_zero_tokens_new_seq():
    bm = BlockManager(num_blocks=1, block_size=4)
    assert bm.allocate(3, 0) == []
    assert bm.has_seq(3) and bm.block_table(3) == []
    bm.allocate(3, 1)
    assert bm.block_table(3) == [0]


def test_errors():
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(KeyError, match="42"):
        bm.free(42)
    with pytest.raises(KeyError):
        bm.truncate(42, 0)
    with pytest.raises(KeyError):
        bm.block_table(42)
    bm.allocate(0, 5)
    with pytest.raises(ValueError):
        bm.truncate(0, 6)
    with pytest.raises(ValueError):
        bm.truncate(0, -1)
    with pytest.raises(ValueError):
        bm.allocate(0, -1)
    bm.allocate(1, 1)
    bm.free(0)
    with pytest.raises(KeyError):
        bm.free(0)
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


NUM_BLOCKS = 6


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/grow/truncate/free/abort against a shadow model.

    The shadow tracks, per sequence, the "content" written at each position
    (unique ints) and a simulated KV store keyed by slot id. After every step
    every sequence must read back exactly its own content through its slot
    mapping, which proves no two sequences write to the same slot.
    """

    block_size = 16

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, self.block_size)
        self.content: dict[int, list[int]] = {}
        self.store: dict[int, int] = {}  # slot -> value
        self.next_seq = 0
        self.next_val = 0

    # helpers --------------------------------------------------------------
    def _snapshot(self):
        bm = self.bm
        return (
            {s: (bm.block_table(s), bm.num_tokens(s)) for s in bm.seq_ids()},
            list(bm._free),
            [bm.ref_count(p) for p in range(bm.num_blocks)],
        )

    def _grow(self, sid: int, total: int, write: bool = True) -> bool:
        old = self.content[sid] if sid in self.content else None
        old_len = len(old) if old is not None else 0
        predicted = self.bm.can_allocate(sid if old is not None else None, total)
        needed = self.bm.num_blocks_needed(sid if old is not None else None, total)
        assert predicted == (needed <= self.bm.num_free_blocks)
        before = self._snapshot()
        try:
            new_pages = self.bm.allocate(sid, total)
        except NoFreeBlocksError:
            assert not predicted
            assert self._snapshot() == before, "failed allocate changed state"
            return False
        assert predicted
        assert len(new_pages) == needed
        assert len(set(new_pages)) == len(new_pages)
        assert self.bm.num_free_blocks == len(before[1]) - needed
        if old is None:
            self.content[sid] = []
        if write and total > old_len:
            slots = self.bm.slot_mapping(sid, old_len, total)
            for slot in slots:
                self.store[slot] = self.next_val
                self.content[sid].append(self.next_val)
                self.next_val += 1
        return True

    def _pick(self, i: int) -> int:
        ids = sorted(self.content)
        return ids[i % len(ids)]

    # rules ------------------------------------------------------------------
    @rule(n=st.integers(0, 3 * 16 + 2))
    def new_seq(self, n):
        n = n % (3 * self.block_size + 2)
        sid = self.next_seq
        self.next_seq += 1
        self._grow(sid, n)

    @precondition(lambda self: self.content)
    @rule(i=st.integers(0, 100), extra=st.integers(0, 2 * 16 + 1))
    def grow(self, i, extra):
        extra = extra % (2 * self.block_size + 2)
        sid = self._pick(i)
        self._grow(sid, len(self.content[sid]) + extra)

    @precondition(lambda self: self.content)
    @rule(i=st.integers(0, 100), k=st.integers(0, 100))
    def truncate(self, i, k):
        sid = self._pick(i)
        n = len(self.content[sid])
        k = k % (n + 1)
        free_before = self.bm.num_free_blocks
        pages_before = len(self.bm.block_table(sid))
        self.bm.truncate(sid, k)
        del self.content[sid][k:]
        dropped = pages_before - len(self.bm.block_table(sid))
        assert len(self.bm.block_table(sid)) == -(-k // self.block_size)
        assert self.bm.num_free_blocks <= free_before + dropped

    @precondition(lambda self: self.content)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        sid = self._pick(i)
        self.bm.free(sid)
        del self.content[sid]
        assert not self.bm.has_seq(sid)

    @precondition(lambda self: self.content)
    @rule(i=st.integers(0, 100), extra=st.integers(1, 2 * 16 + 1))
    def abort_midway(self, i, extra):
        """Reserve slots for a speculative step, then abort before writing."""
        sid = self._pick(i)
        self._grow(sid, len(self.content[sid]) + extra, write=False)
        self.bm.free(sid)
        del self.content[sid]

    @rule(i=st.integers(0, 100))
    def free_unknown_raises(self, i):
        missing = self.next_seq + i
        with pytest.raises(KeyError, match=str(missing)):
            self.bm.free(missing)

    # invariants --------------------------------------------------------------
    @invariant()
    def bookkeeping_consistent(self):
        self.bm.check_invariants()
        assert set(self.bm.seq_ids()) == set(self.content)
        owned = {p for s in self.content for p in self.bm.block_table(s)}
        assert self.bm.num_free_blocks == NUM_BLOCKS - len(owned)
        assert self.bm.usage == pytest.approx(len(owned) / NUM_BLOCKS)

    @invariant()
    def no_page_shared(self):
        holders = [p for s in self.content for p in self.bm.block_table(s)]
        assert len(holders) == len(set(holders)), "a page is held by two sequences"

    @invariant()
    def every_seq_reads_its_own_content(self):
        for s, vals in self.content.items():
            assert self.bm.num_tokens(s) == len(vals)
            slots = self.bm.slot_mapping(s, 0, len(vals))
            assert [self.store.get(x) for x in slots] == vals

    def teardown(self):
        for s in list(self.content):
            self.bm.free(s)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.usage == 0.0


def _machine(bs: int):
    cls = type(f"BlockManagerMachineBS{bs}", (BlockManagerMachine,), {"block_size": bs})
    cls.TestCase.settings = settings(
        max_examples=150, stateful_step_count=40, deadline=None
    )
    return cls


TestMachineBS1 = _machine(1).TestCase
TestMachineBS3 = _machine(3).TestCase
TestMachineBS16 = _machine(16).TestCase
