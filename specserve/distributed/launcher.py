"""Starting, watching and stopping the tensor-parallel ranks.

Two ways in, as in vLLM:

* the engine starts ``tensor_parallel_size - 1`` worker processes itself (``spawn``), hands each its
  shard of the weights (through shared memory: workers never read model files) and becomes rank 0;
* under ``torchrun`` (``WORLD_SIZE`` equal to ``tensor_parallel_size`` in the environment) every
  rank runs the same program; each loads the model and keeps its shard, rank 0 goes on as the
  engine and the other ranks serve it from inside :func:`~specserve.distributed.target.build_target`
  (called by the engine's constructor), then exit the process (``SystemExit(0)``) when the leader
  shuts down.

Faults: the leader notices a worker that exits (its exit code, and the traceback it sent) before
every step and in ``/health``; a worker that hangs fails the next collective after the compute
group's timeout. A spawned worker whose leader disappears exits within a second.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.distributed.group import TensorParallelError, TensorParallelGroup

logger = logging.getLogger(__name__)

# workers wait for the next step on the control group while the engine is idle: a long timeout,
# kept from expiring by the leader's keep-alive messages
CONTROL_TIMEOUT = timedelta(days=1)
STARTUP_TIMEOUT_S = 600.0
_num_external_engines = 0   # engines made under torchrun in this process: each gets its own store prefix


def device_for_rank(device: str, local_rank: int) -> torch.device:
    """The device of the rank with this machine-local index: ``cuda`` (or ``cuda:i``) means
    ``cuda:<i + local_rank>``, one GPU per rank; CPU is shared."""
    d = torch.device(device)
    if d.type == "cuda":
        return torch.device("cuda", (d.index or 0) + local_rank)
    return d


def under_torchrun(world_size: int) -> bool:
    """True when this process is one of ``world_size`` ranks a launcher (torchrun) started."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == world_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _worker_main(rank: int, world_size: int, port: int, timeout_s: float, threads: int, build: dict, errors,
                 parent: int) -> None:
    """A spawned worker: join the group, build its shard, serve the leader's steps."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        torch.set_num_threads(threads)
        device = device_for_rank(build["device"], rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        group = TensorParallelGroup(store, rank, world_size, device, timeout_s, CONTROL_TIMEOUT)
        from specserve.distributed.runner import run_worker
        model, kv_cache = build_rank(group, device=device, **{k: v for k, v in build.items() if k != "device"})
        group.ready(STARTUP_TIMEOUT_S)
        run_worker(model, kv_cache, group)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def build_rank(group: TensorParallelGroup, config, weights: dict, shard, quantization: str, num_blocks: int,
               block_size: int, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None):
    """This rank's model (from its ``weights`` shard) and KV cache (its KV heads)."""
    from specserve.kv_cache.kv_cache import KVCache
    from specserve.models.llama import LlamaForCausalLM
    from specserve.models.quantization import to_device

    group.shard = shard
    model = LlamaForCausalLM(config, to_device(weights, device, dtype), quantization, tp=group).eval()
    kv_cache = KVCache(config.num_hidden_layers, num_blocks, block_size, shard.num_kv_heads, config.head_dim,
                       kv_dtype or dtype, device)
    return model, kv_cache


class TensorParallelLauncher:
    """The ranks of one engine's tensor-parallel group, seen from this process.

    Args:
        world_size: ``tensor_parallel_size``.
        device: the engine's device (``cpu``: gloo; ``cuda``: NCCL, one GPU per rank).
        timeout_s: the compute group's timeout (a hung worker fails a step after this long).
    """

    def __init__(self, world_size: int, device: str, timeout_s: float):
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.external = under_torchrun(world_size)
        self.rank = int(os.environ["RANK"]) if self.external else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank)) if self.external else 0
        if torch.device(device).type == "cuda":
            need = (torch.device(device).index or 0) + (int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
                                                        if self.external else world_size)
            if torch.cuda.device_count() < need:
                raise ValueError(f"tensor_parallel_size {world_size} on {device!r} needs {need} GPUs, one per rank; "
                                 f"this machine has {torch.cuda.device_count()}")
            # NCCL errors and timeouts then raise on the host (TensorParallelError) instead of
            # aborting the process from NCCL's watchdog
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        self._threads = torch.get_num_threads()   # restored at shutdown (a spawning leader uses fewer)
        self._rank_threads = self._threads         # this rank's share while every rank computes
        self.processes: list = []
        self._errors = None
        self._tracebacks: dict[int, str] = {}   # rank -> the last line of the error it reported
        self._lock = threading.Lock()
        self.group: TensorParallelGroup | None = None
        self.runner = None
        self._store = None
        self._closed = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ start
    def start(self, builds: dict[int, dict] | None = None) -> TensorParallelGroup:
        """Join (torchrun) or start (spawn: ``builds[rank]`` are the workers' build arguments) the
        group; returns this rank's :class:`TensorParallelGroup`.

        Raises:
            TensorParallelError: a worker exited during start-up (with its traceback) or the group
                did not form within ``STARTUP_TIMEOUT_S``.
        """
        device = device_for_rank(self.device, self.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        startup = timedelta(seconds=STARTUP_TIMEOUT_S)
        if self.external:   # torchrun's rendezvous store (its agent hosts it unless told otherwise)
            global _num_external_engines
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world_size,
                                  self.rank == 0 and not agent, timeout=startup)
            store = dist.PrefixStore(f"specserve-engine{_num_external_engines}", store)
            _num_external_engines += 1
            self.group = TensorParallelGroup(store, self.rank, self.world_size, device, self.timeout_s,
                                             CONTROL_TIMEOUT)
        else:
            self.group = self._spawn(builds or {}, device)
        return self.group

    def _spawn(self, builds: dict[int, dict], device: torch.device) -> TensorParallelGroup:
        ctx = torch.multiprocessing.get_context("spawn")
        self._errors = ctx.SimpleQueue()
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, self.world_size, True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                              wait_for_workers=False)
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        torch.set_num_threads(threads)     # the leader is one of the ranks sharing this machine's cores
        self._rank_threads = threads
        for rank in range(1, self.world_size):
            p = ctx.Process(target=_worker_main, name=f"specserve-tp-rank{rank}", daemon=True,
                            args=(rank, self.world_size, port, self.timeout_s, threads, builds[rank], self._errors,
                                  os.getpid()))
            p.start()
            self.processes.append(p)
        done: list = []

        def join() -> None:   # blocks until every worker has joined
            try:
                done.append(TensorParallelGroup(store, 0, self.world_size, device, self.timeout_s, CONTROL_TIMEOUT,
                                                describe_failure=self.describe_failure))
            except BaseException as e:   # reported by the main thread
                done.append(e)

        t = threading.Thread(target=join, daemon=True)
        t.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while t.is_alive():
            t.join(0.1)
            problem = self.describe_failure()
            if problem or time.monotonic() > deadline:
                self.kill()
                raise TensorParallelError(f"tensor-parallel start-up failed: "
                                          f"{problem or f'the group did not form within {STARTUP_TIMEOUT_S:g} s'}")
        if isinstance(done[0], BaseException):
            self.kill()
            raise TensorParallelError(f"tensor-parallel start-up failed: {done[0]!r}")
        self._store = store   # the rendezvous server lives as long as the group
        return done[0]

    @contextlib.contextmanager
    def leader_alone(self):
        """Work only the leader does while the workers wait for the next step (the draft's
        catch-up and proposals): on a CPU shared by spawned ranks the leader takes every core the
        engine had for it, then goes back to its share. The workers block in a gloo receive while
        they wait (no spinning: tests/test_tensor_parallel.py measures their CPU time), so the cores
        are free. Elsewhere (GPUs; torchrun's ranks, whose threads the launcher never split) nothing
        changes."""
        if torch.device(self.device).type != "cpu" or self._threads <= self._rank_threads:
            yield
            return
        torch.set_num_threads(self._threads)
        try:
            yield
        finally:   # a shutdown from another thread meanwhile already gave the process its cores back
            torch.set_num_threads(self._threads if self._closed else self._rank_threads)

    # ------------------------------------------------------------------ health
    def describe_failure(self) -> str:
        """What is wrong with the spawned workers ('' when every one is alive)."""
        problems = []
        with self._lock:      # the engine's thread and the server's /health both ask
            while self._errors is not None and not self._errors.empty():
                rank, tb = self._errors.get()
                self._tracebacks[rank] = tb.strip().splitlines()[-1]
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                why = f": {self._tracebacks[rank]}" if rank in self._tracebacks else ""
                problems.append(f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}{why}")
        return "; ".join(problems)

    def problem(self) -> TensorParallelError | None:
        """Why the group cannot serve (a failed collective, a worker that exited), or None; a lost
        worker is recorded as the group's failure. Any thread."""
        if self.group is not None and self.group.failed is not None:
            return self.group.failed
        lost = self.describe_failure()
        if not lost:
            return None
        err = TensorParallelError(f"tensor-parallel group lost a rank: {lost}")
        if self.group is not None:
            self.group.failed = err
        return err

    def check(self) -> None:
        """Raise :meth:`problem`, if there is one."""
        err = self.problem()
        if err is not None:
            raise err

    # ------------------------------------------------------------------ stop
    def kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(5)

    def shutdown(self, polite: bool = True) -> None:
        """Stop every worker (with a message when the group is healthy and ``polite``, else by
        killing them) and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        healthy = polite and self.group is not None and self.group.failed is None and not self.describe_failure()
        if healthy and self.runner is not None and self.is_leader:
            try:
                self.runner.shutdown()
            except TensorParallelError:
                healthy = False
        deadline = time.monotonic() + (10.0 if healthy else 0.0)
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()
        if self.processes:
            torch.set_num_threads(self._threads)
        if self.group is not None:   # the private process groups close when dropped
            self.group.failed = self.group.failed or TensorParallelError("the tensor-parallel group was shut down")
            self.group.control = self.group.compute = None
        self._store = None
