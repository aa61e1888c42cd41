"""The tensor-parallel group's collectives (torch.distributed: gloo on CPU, NCCL on CUDA).

Two process groups over the same ranks: the *control* group carries the leader's step messages
(workers wait on it while the engine is idle, so its timeout is long), the *compute* group carries
the all-reduces and gathers inside a forward, with a bounded timeout, so a worker that died or hangs
fails the leader's step within that time instead of blocking it forever.

The all-reduce is exact and row-wise: with two ranks one addition per element (commutative, so
every rank holds the same bits); with more, every rank gathers all partial sums and adds them in
rank order. Ring all-reduces of more ranks add in an order that depends on the tensor's size, which
would make a row's result depend on how many rows share the step (batch invariance, docs/architecture.md).
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung past the timeout, or could not start; the engine cannot
    continue."""


def _process_group(backend: str, store, rank: int, world_size: int, timeout: timedelta):
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class TensorParallelGroup:
    """This rank's view of the group: two private process groups over one rendezvous store (no
    global default group, so several engines, each with its own workers, can live in one process).

    Args:
        store: the rendezvous store (a ``torch.distributed.TCPStore``) every rank shares.
        rank / world_size: this process's rank and the group's size.
        device: where this rank's tensors live (NCCL communicates CUDA tensors).
        timeout_s: the compute group's timeout, seconds.
        control_timeout: the control group's timeout (workers wait on it while the engine is idle).
        describe_failure: called when a collective fails; returns what is known about the workers
            (the leader reports which one exited) for the error message.
    Raises:
        RuntimeError: from torch.distributed when the other ranks do not join within the store's timeout.
    """

    def __init__(self, store, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 control_timeout: timedelta, describe_failure=None):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.control = _process_group(self.backend, dist.PrefixStore("specserve/control", store), rank, world_size,
                                      control_timeout)
        self.compute = _process_group(self.backend, dist.PrefixStore("specserve/compute", store), rank, world_size,
                                      timedelta(seconds=timeout_s))
        self.describe_failure = describe_failure or (lambda: "")
        self.failed: TensorParallelError | None = None
        self.shard = None     # this rank's TensorParallelShard, set when the model is built
        # per collective ("all-reduce", "all-gather", "broadcast"): calls, bytes sent by this rank's
        # tensor, seconds spent in them (waiting for the slowest rank included); benchmarks read these
        self.stats: dict[str, list] = {}

    def _fail(self, what: str, e: BaseException) -> TensorParallelError:
        detail = self.describe_failure()
        for _ in range(20):      # a rank whose socket closed is usually exiting: wait for its exit code
            if detail:
                break
            time.sleep(0.1)
            detail = self.describe_failure()
        self.failed = TensorParallelError(
            f"tensor-parallel {what} failed on rank {self.rank} of {self.world_size}: "
            f"{detail or f'a rank died or did not answer within {self.timeout_s:g} s'} ({type(e).__name__}: {e})")
        return self.failed

    def _run(self, what: str, start, x: torch.Tensor) -> None:
        if self.failed is not None:
            raise self.failed
        t0 = time.perf_counter()
        try:
            start().wait()
        except RuntimeError as e:   # gloo / NCCL errors and timeouts (DistBackendError is one)
            raise self._fail(what, e) from None
        st = self.stats.setdefault(what, [0, 0, 0.0])
        st[0] += 1
        st[1] += x.numel() * x.element_size()
        st[2] += time.perf_counter() - t0

    def ready(self, timeout_s: float) -> None:
        """Every rank has built its shard within ``timeout_s`` (a worker that failed to fails this,
        with its error). On the control group: building takes longer than a step."""
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=timeout_s)
        x = torch.ones(1, device=self.device)
        self._run("start-up barrier", lambda: self.control.allreduce([x], opts), x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's ``x`` (same shape on each), the same bits on every rank."""
        if self.world_size == 2:
            self._run("all-reduce", lambda: self.compute.allreduce([x]), x)
            return x
        parts = self.all_gather(x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on each), in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._run("all-gather", lambda: self.compute.allgather([parts], [x]), x)
        return parts

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of rank ``src``, in place on every rank, on the control group: receivers wait as
        long as the engine idles, the sender (a gloo send waits for the receiver) only the compute
        timeout."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if src == self.rank:
            opts.timeout = timedelta(seconds=self.timeout_s)
        self._run("broadcast", lambda: self.control.broadcast([x], opts), x)
        return x
