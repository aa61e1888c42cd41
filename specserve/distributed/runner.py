"""The target's runner under tensor parallelism: one packed step message, the same forward on every rank.

Rank 0 (the leader) runs the scheduler, the sampler and the proposer. For each target forward it
packs everything a worker needs into one int64 tensor and broadcasts it
(:func:`pack_step_message`): input ids, positions, per sequence its context and query lengths and
block table, the rows whose logits the step needs, the tree masks of a tree verification, the
target's auxiliary layers (EAGLE-3), and the KV moves of the last tree acceptance. Each worker
unpacks it into the same arguments and calls the same :class:`~specserve.worker.model_runner.ModelRunner`
on its shard, so :class:`~specserve.attention.metadata.AttentionMetadata` (slot mapping included)
is built by the same code from the same numbers on every rank. The forward's all-reduces leave the
full hidden states on every rank, so heads on the leader read them as they do without parallelism.

The message lives in a buffer of fixed capacity (a broadcast needs its size known on both sides); a
step that needs more first sends a resize, after which the bigger buffer stays.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from specserve.distributed.group import TensorParallelError, TensorParallelGroup
from specserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

OP_FORWARD, OP_LOGITS, OP_RESIZE, OP_NOOP, OP_SHUTDOWN = 1, 2, 3, 4, 5
# header: op, length, B, T, n_aux, n_logit_rows, n_moves, n_mask_values, n_table_values, has_trees
HEADER = 10
INITIAL_CAPACITY = 4096


def pack_step_message(input_ids: torch.Tensor, positions, block_tables: list[list[int]], context_lens: list[int],
                      query_lens: list[int], logits_rows: list[int] | None, tree_masks, aux_layers,
                      moves: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One forward's arguments as an int64 tensor on ``input_ids``' device (see :func:`unpack_step_message`).

    Layout: a header of ``HEADER`` ints, then aux layers, context lens [B], query lens [B], table
    lengths [B], the block tables' page ids, positions [T], logit rows, KV move sources and targets,
    per sequence its tree mask's shape (two ints; 0, 0 for none) and the masks' values, and last
    the input ids [T] (drafts may live on the device: they are appended there, never read back).
    """
    b, t = len(context_lens), int(input_ids.shape[0])
    rows = list(logits_rows or [])
    src = [int(s) for m in moves for s in m[0].tolist()]
    dst = [int(s) for m in moves for s in m[1].tolist()]
    shapes, values = [], []
    if tree_masks is not None:
        for m in tree_masks:
            shapes.extend(m.shape if m is not None else (0, 0))
            if m is not None:
                values.extend(m.reshape(-1).to(torch.int64).tolist())
    tables = [p for tb in block_tables for p in tb]
    pos = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
    body = [*aux_layers, *context_lens, *query_lens, *(len(tb) for tb in block_tables), *tables, *pos, *rows,
            *src, *dst, *shapes, *values]
    header = [OP_FORWARD, HEADER + len(body) + t, b, t, len(aux_layers), len(rows), len(src), len(values),
              len(tables), int(tree_masks is not None)]
    host = torch.tensor(header + body, dtype=torch.int64)
    return torch.cat([host.to(input_ids.device), input_ids.to(torch.int64)])


def unpack_step_message(msg: torch.Tensor) -> dict:
    """The arguments :func:`pack_step_message` packed (host lists; ``input_ids`` a tensor on ``msg``'s device)."""
    head = msg[:HEADER].tolist()
    _, length, b, t, n_aux, n_rows, n_moves, n_values, n_tables, has_trees = head
    host = msg[HEADER:length - t].tolist()
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return host[at - n:at]
    aux = take(n_aux)
    context_lens, query_lens, table_lens = take(b), take(b), take(b)
    flat_tables = take(n_tables)
    block_tables, i = [], 0
    for n in table_lens:
        block_tables.append(flat_tables[i:i + n])
        i += n
    positions, rows = take(t), take(n_rows)
    src, dst = take(n_moves), take(n_moves)
    tree_masks = None
    if has_trees:
        shapes = take(2 * b)
        values = take(n_values)
        tree_masks, i = [], 0
        for q, width in zip(shapes[0::2], shapes[1::2]):
            if q == 0:
                tree_masks.append(None)
                continue
            tree_masks.append(torch.tensor(values[i:i + q * width], dtype=torch.bool).reshape(q, width))
            i += q * width
    return dict(input_ids=msg[length - t:length], positions=positions, block_tables=block_tables,
                context_lens=context_lens, query_lens=query_lens, logits_rows=rows, tree_masks=tree_masks,
                aux_layers=tuple(aux), moves=(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)))


class StepChannel:
    """The leader -> workers message buffer over the group's control broadcast."""

    def __init__(self, group: TensorParallelGroup, capacity: int = INITIAL_CAPACITY):
        self.group = group
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=group.device)
        self.num_messages = 0
        self.bytes_sent = 0       # capacity broadcast (what the wire carries)
        self.bytes_used = 0       # message lengths
        self.last_sent = time.monotonic()

    def _broadcast(self) -> None:
        self.group.broadcast(self.buffer)
        self.last_sent = time.monotonic()
        self.num_messages += 1
        self.bytes_sent += self.buffer.numel() * 8

    def send(self, msg: torch.Tensor) -> None:
        """Broadcast ``msg`` (int64 ``[n]``), growing the buffer first when it does not fit (leader)."""
        n = int(msg.shape[0])
        if n > self.buffer.numel():
            capacity = max(n, 2 * self.buffer.numel())
            self.buffer[:2] = torch.tensor([OP_RESIZE, capacity])
            self._broadcast()
            self.buffer = torch.zeros(capacity, dtype=torch.int64, device=self.group.device)
        self.buffer[:n] = msg
        self.bytes_used += n * 8
        self._broadcast()

    def send_op(self, op: int, payload: list[int] = ()) -> None:
        self.send(torch.tensor([op, 2 + len(payload), *payload], dtype=torch.int64))

    def receive(self) -> torch.Tensor:
        """The next message (workers); resizes are handled here."""
        while True:
            self.group.broadcast(self.buffer)
            op, value = self.buffer[:2].tolist()
            if op != OP_RESIZE:
                return self.buffer
            self.buffer = torch.zeros(value, dtype=torch.int64, device=self.group.device)


class TensorParallelRunner(ModelRunner):
    """The leader's :class:`ModelRunner`: each call first tells the workers to make the same one.

    Args:
        model: rank 0's shard of the target (built with ``tp=group``).
        kv_cache: rank 0's KV tensors (its KV heads).
        group: the tensor-parallel group.
    """

    def __init__(self, model, kv_cache, group: TensorParallelGroup):
        super().__init__(model, kv_cache)
        self.group = group
        self.channel = StepChannel(group)
        self._pending_moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._last_hidden: torch.Tensor | None = None

    def forward_tensors(self, input_ids, positions, block_tables, context_lens, query_lens, tree_masks=None):
        return self.forward_with_logits(input_ids, positions, block_tables, context_lens, query_lens, [],
                                        tree_masks)[0]

    @contextmanager
    def _in_step(self):
        """An exception between a message and the end of its collectives (an interrupt, an error
        on this rank only) leaves the workers waiting inside the step: the group is out of step
        for good, so it is marked failed and the engine stops instead of pairing the wrong
        collectives later."""
        try:
            yield
        except BaseException as e:
            if self.group.failed is None:
                self.group.failed = TensorParallelError(
                    f"a tensor-parallel step was interrupted on rank 0 ({type(e).__name__}: {e}); "
                    f"the ranks are out of step and the engine cannot continue")
            raise

    def forward_with_logits(self, input_ids, positions, block_tables, context_lens, query_lens, logits_rows,
                            tree_masks=None):
        with self._in_step():
            self.channel.send(pack_step_message(input_ids, positions, block_tables, context_lens, query_lens,
                                                logits_rows, tree_masks, self.model.aux_hidden_state_layers,
                                                self._pending_moves))
            self._pending_moves = []
            hidden = super().forward_tensors(input_ids, positions, block_tables, context_lens, query_lens,
                                             tree_masks)
            self._last_hidden = hidden
            return hidden, super().compute_logits(hidden, logits_rows) if logits_rows else None

    def compute_logits(self, hidden_states: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of rows of the last forward's hidden states (the workers hold the same ones).

        Raises:
            ValueError: ``hidden_states`` are not the last forward's output.
        """
        if hidden_states is not self._last_hidden:
            raise ValueError("under tensor parallelism logits are computed from the last forward's hidden states only")
        with self._in_step():
            self.channel.send_op(OP_LOGITS, list(rows))
            return super().compute_logits(hidden_states, rows)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move here now, on the workers before their next forward (nothing reads their caches sooner)."""
        super().move_kv(src, dst)
        self._pending_moves.append((src.cpu(), dst.cpu()))

    def keepalive(self) -> None:
        """An empty message, so idle workers never reach the control group's timeout."""
        self.channel.send_op(OP_NOOP)

    def shutdown(self) -> None:
        """Tell the workers to leave their loop."""
        self.channel.send_op(OP_SHUTDOWN)


def run_worker(model, kv_cache, group: TensorParallelGroup) -> None:
    """A worker rank's loop: receive a message, run the same forward / logits as the leader, until shutdown."""
    runner = ModelRunner(model, kv_cache)
    channel = StepChannel(group)
    last_hidden = None
    while True:
        msg = channel.receive()
        op = int(msg[0])
        if op == OP_SHUTDOWN:
            return
        if op == OP_NOOP:
            continue
        if op == OP_LOGITS:
            n = int(msg[1])
            runner.compute_logits(last_hidden, msg[2:n].tolist())
            continue
        if op != OP_FORWARD:
            raise RuntimeError(f"unknown tensor-parallel message op {op}")
        a = unpack_step_message(msg)
        src, dst = a["moves"]
        if len(src):
            runner.move_kv(src, dst)
        model.aux_hidden_state_layers = a["aux_layers"]
        last_hidden, _ = runner.forward_with_logits(a["input_ids"].clone(), a["positions"], a["block_tables"],
                                                    a["context_lens"], a["query_lens"], a["logits_rows"],
                                                    a["tree_masks"])
