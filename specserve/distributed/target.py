"""The target over ``tensor_parallel_size`` ranks, behind the same handle as a local one.

:func:`build_target` is the one place an engine's target is built: a
:class:`~specserve.worker.target.Target` in this process, or a :class:`TensorParallelTarget` whose
model is rank 0's shard and whose runner makes every worker rank run the same forward
(:mod:`specserve.distributed.runner`). Under torchrun the other ranks never return from
:func:`build_target`: they serve rank 0 until it shuts down, then end the process
(``SystemExit(0)``).
"""
from __future__ import annotations

import time
import weakref

import torch

from specserve.config import EngineArgs
from specserve.models.loader import LoadedModel
from specserve.models.quantization import to_device
from specserve.worker.target import SHARED_WEIGHTS, Target, kv_pool_size


def build_target(args: EngineArgs, loaded: LoadedModel, dtype: torch.dtype, kv_dtype: torch.dtype) -> Target:
    """The engine's target: local, or over ``args.tensor_parallel_size`` ranks.

    Raises:
        ValueError: a model that cannot be split over the ranks (names the sizes).
        TensorParallelError: the ranks did not start (with a worker's traceback).
    """
    if args.tensor_parallel_size > 1:
        return TensorParallelTarget.build(args, loaded, dtype, kv_dtype)
    return Target.build(args, loaded, dtype, kv_dtype)


class TensorParallelTarget(Target):
    """Rank 0's view of the target under tensor parallelism (the ranks stop when this is
    collected, at exit, or at :meth:`shutdown`, whichever is first).

    Attributes:
        launcher: the :class:`~specserve.distributed.launcher.TensorParallelLauncher` (its
            processes, group and runner).
    """

    launcher = None

    @classmethod
    def build(cls, args: EngineArgs, loaded: LoadedModel, dtype: torch.dtype,
              kv_dtype: torch.dtype) -> TensorParallelTarget:
        from specserve.distributed.launcher import TensorParallelLauncher

        launcher = TensorParallelLauncher(args.tensor_parallel_size, args.device, args.distributed_timeout_s)
        try:
            return cls._start(launcher, args, loaded, dtype, kv_dtype)
        except BaseException:   # a failed start leaves no worker behind
            launcher.shutdown()
            raise

    @classmethod
    def _start(cls, launcher, args: EngineArgs, loaded: LoadedModel, dtype: torch.dtype,
               kv_dtype: torch.dtype) -> TensorParallelTarget:
        """Plan the shards (checked before anything starts), size the pool for the largest shard's
        KV heads, start (or, under torchrun, join) the ranks, build this rank's shard."""
        from specserve.distributed.launcher import STARTUP_TIMEOUT_S, build_rank
        from specserve.distributed.runner import TensorParallelRunner, run_worker
        from specserve.distributed.sharding import plan_shard, shard_weights

        cfg, weights = loaded.config, loaded.weights   # the full weights stay on the host
        shards = [plan_shard(cfg, r, launcher.world_size, args.quantization != "none")
                  for r in range(launcher.world_size)]
        num_blocks, max_model_len = kv_pool_size(args, cfg, max(s.num_kv_heads for s in shards), kv_dtype)
        common = dict(config=cfg, quantization=args.quantization, num_blocks=num_blocks, block_size=args.block_size,
                      dtype=dtype, kv_dtype=kv_dtype)
        builds = None
        if not launcher.external:   # spawned workers get their shards through shared memory
            builds = {r: dict(common, weights=shard_weights(cfg, weights, shards[r]), shard=shards[r],
                              device=args.device) for r in range(1, launcher.world_size)}
        group = launcher.start(builds)
        builds = None
        model, kv_cache = build_rank(group, weights=shard_weights(cfg, weights, shards[launcher.rank]),
                                     shard=shards[launcher.rank], device=group.device, **common)
        group.ready(STARTUP_TIMEOUT_S)
        if not launcher.is_leader:
            try:
                run_worker(model, kv_cache, group)
            finally:
                launcher.shutdown()
            raise SystemExit(0)
        launcher.runner = TensorParallelRunner(model, kv_cache, group)
        shared = to_device({k: weights[k] for k in SHARED_WEIGHTS if k in weights}, args.device, dtype)
        target = cls(model, kv_cache, launcher.runner, num_blocks, max_model_len, shared)
        target.launcher = launcher
        weakref.finalize(target, launcher.shutdown)
        return target

    def draft_context(self):
        """The draft lives on the leader: it drafts with the workers' cores too."""
        return self.launcher.leader_alone()

    def check(self) -> None:
        self.launcher.check()   # a lost rank fails the step here, with its exit code

    def health(self) -> str | None:
        err = self.launcher.problem()
        return None if err is None else str(err)

    def keepalive(self, idle_s: float = 600.0) -> None:
        """Ping the workers when nothing was sent for ``idle_s`` seconds, so their wait for the
        next step never times out."""
        runner = self.launcher.runner
        if runner is not None and time.monotonic() - runner.channel.last_sent > idle_s:
            self.launcher.check()
            runner.keepalive()

    def communication_stats(self) -> dict | None:
        channel = self.launcher.runner.channel
        return {"collectives": {k: list(v) for k, v in self.launcher.group.stats.items()},
                "bytes_sent": channel.bytes_sent, "bytes_used": channel.bytes_used}

    def shutdown(self, polite: bool = True) -> None:
        """Stop the workers (``polite=False``: kill them without a message; another thread may
        still be in a step). Idempotent."""
        self.launcher.shutdown(polite)
