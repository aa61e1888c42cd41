"""Train a draft head on precomputed target hidden states (EAGLE's and EAGLE-3's objectives).

Loss per predicted position (Li et al. 2024, "EAGLE", section 4.2):

    hidden_loss_weight * SmoothL1(head hidden, target's next hidden state)
  + ce_weight * CE(target's next-token distribution, softmax(lm_head(head hidden)))

with EAGLE's defaults 1.0 and 0.1. An ``eagle3`` head is trained on the tokens only (Li et al.
2025, "EAGLE-3", section 3: no feature regression; defaults 0.0 and 1.0): its output is not in
the target's feature space. The target distribution is its stored top-k, renormalized over the
tokens the head can score (all, or the reduced draft vocabulary).

With ``unroll_steps`` > 1 the head is also trained on its own outputs (EAGLE-3's "training-time
test"): step j feeds step j-1's predicted hidden states (and the true next tokens) and predicts j
positions further, as it will when drafting a chain. Step j's attention sees what it will see at
inference: the keys step 0 made from the target's features up to the accepted position, and the
chain's own keys of steps 1 .. j at the same row
(:func:`~specserve.models.draft_head._training_time_test_attention`).

With ``feature_noise`` a > 0 the target's features that the head reads are perturbed while
training (Li et al. 2024, "EAGLE", section 4.2: uniform noise on the features, U(-0.1, 0.1) there,
so that the head copes with the errors of its own predicted features and fits less of the
training set). EAGLE adds it to final-norm features of scale ~1; here each feature vector (each
fused layer's for ``eagle3``, whose residual streams differ in scale by orders of magnitude) gets
U(-a, a) times its own root mean square. The regression and cross-entropy targets stay clean.

AdamW, linear warmup then cosine decay to ``min_lr_ratio`` of the peak, gradient clipping; float32,
or with ``mixed_precision="bfloat16"`` the forward and backward matmuls in bfloat16 (``torch.autocast``)
over float32 weights, optimizer state and losses (no loss scaling: bfloat16 has float32's range).
Several processes (``torchrun --nproc-per-node N -m specserve.entrypoints.cli train-head ...``)
train with DistributedDataParallel (over :class:`HeadLoss`, the whole unrolled loss): each rank
takes every N-th example of the same shuffled order, gradients are averaged, rank 0 logs and saves.

Long runs resume: every ``checkpoint_every`` steps rank 0 writes ``out_dir/checkpoint.pt`` (the
head's weights, AdamW's state, the step, the data order and random state), and a rerun with the
same settings on the same data goes on from it, to the same weights bit for bit as a run never
interrupted. The checkpoint is removed once the head is written.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from specserve.models.draft_head import DraftHead
from specserve.models.draft_head_config import DraftHeadConfig
from specserve.results import write_json
from specserve.spec_decode.draft_vocab import frequent_token_vocab
from specserve.training.dataset import Batch, HiddenStateDataset


@dataclass
class TrainConfig:
    """Head training settings (defaults: EAGLE's loss weights; a CPU-sized run)."""

    variant: str = "normed"
    intermediate_size: int | None = None
    draft_vocab_size: int | None = None
    num_steps: int = 1000
    batch_size: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 0.5
    hidden_loss_weight: float | None = None   # None: 1.0, and 0.0 for eagle3
    ce_weight: float | None = None            # None: 0.1, and 1.0 for eagle3
    unroll_steps: int = 1
    feature_noise: float = 0.0                # U(-a, a) x RMS added to the input features while training
    own_lm_head: bool = False                 # eagle3: train its own lm_head (saved with the head)
    init_from_target: bool = False            # start the decoder layer from the target's last one
    max_train_tokens: int | None = None       # the first N tokens of the training split (data scaling)
    val_fraction: float = 0.05
    eval_every: int = 250
    eval_chain: int = 4
    max_eval_segments: int = 64        # validation segments of the periodic evaluations (the first and
                                       # last use all of them)
    seed: int = 0
    save_dtype: str = "float16"
    mixed_precision: str = "none"      # "bfloat16": matmuls under torch.autocast, float32 weights and
                                       # optimizer (2.5x the float32 matmul rate on an AVX512-BF16 CPU)
    checkpoint_every: int = 100        # steps between resumable checkpoints; 0: none
    length_multiple: int = 64          # batches padded to a multiple of this length: with segments of
                                       # every length, each new shape made oneDNN cache more primitives
                                       # (resident memory grew ~1.2 GB/min and steps slowed 2x)

    def __post_init__(self) -> None:
        eagle3 = self.variant == "eagle3"
        if self.hidden_loss_weight is None:
            self.hidden_loss_weight = 0.0 if eagle3 else 1.0
        if self.ce_weight is None:
            self.ce_weight = 1.0 if eagle3 else 0.1
        if self.own_lm_head and not eagle3:
            raise ValueError(f"own_lm_head is for variant 'eagle3', not {self.variant!r}")
        if eagle3 and self.hidden_loss_weight:
            raise ValueError("an eagle3 head has no target feature to regress to: hidden_loss_weight must be 0")
        if not 0 <= self.feature_noise < 1:
            raise ValueError(f"feature_noise must be in [0, 1), got {self.feature_noise}")
        if self.max_train_tokens is not None and self.max_train_tokens < 1:
            raise ValueError(f"max_train_tokens must be >= 1, got {self.max_train_tokens}")
        for name in ("num_steps", "batch_size", "unroll_steps", "eval_every", "eval_chain", "max_eval_segments",
                     "length_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        for name in ("lr", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.mixed_precision not in ("none", "bfloat16"):
            raise ValueError(f"mixed_precision must be 'none' or 'bfloat16', got {self.mixed_precision!r}")
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"save_dtype must be float16, bfloat16 or float32, got {self.save_dtype!r}")


def autocast(cfg: TrainConfig, device: str | torch.device):
    """The training forward's precision context: ``torch.autocast`` to bfloat16, or a no-op."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bfloat16")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _soft_ce(head: DraftHead, pred: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
             target_to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy against the renormalized top-k and the head's argmax (target ids).
    pred ``[R, H]``, ids/probs ``[R, K]`` -> ``([R], [R])``."""
    logq = torch.log_softmax(head.compute_logits(pred), dim=-1)        # [R, N]
    draft_ids = target_to_draft[ids]                                    # [R, K], -1 outside the vocab
    p = probs * (draft_ids >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    ce = -(p * logq.gather(1, draft_ids.clamp_min(0))).sum(-1)
    return ce, head.draft_to_target[logq.argmax(-1)]


def chunked_ce(head: DraftHead, pred: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
               target_to_draft: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_soft_ce` in row chunks, each recomputed in the backward pass, so the ``[rows, vocab]``
    logits never exist for the whole batch at once (151,936 floats per row for Qwen)."""
    ces, tops = [], []
    for s in range(0, pred.shape[0], chunk):
        args = (pred[s:s + chunk], ids[s:s + chunk], probs[s:s + chunk])
        if pred.requires_grad:
            ce, top = checkpoint(lambda a, b, c: _soft_ce(head, a, b, c, target_to_draft), *args, use_reentrant=False)
        else:
            ce, top = _soft_ce(head, *args, target_to_draft)
        ces.append(ce)
        tops.append(top)
    return torch.cat(ces), torch.cat(tops)


def add_feature_noise(features: torch.Tensor, amplitude: float, width: int) -> torch.Tensor:
    """``features [..., k * width]`` plus, for each ``width``-wide vector, uniform noise in
    ``(-amplitude, amplitude)`` times that vector's root mean square (EAGLE's feature noise, scaled;
    see the module docstring). Draws from torch's global generator (saved with a checkpoint)."""
    if amplitude == 0:
        return features
    x = features.unflatten(-1, (-1, width))
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
    noise = (torch.rand(x.shape, device=x.device) * 2 - 1) * amplitude * rms
    return (x + noise.to(x.dtype)).flatten(-2)


def head_losses(head: DraftHead, batch: Batch, cfg: TrainConfig, target_to_draft: torch.Tensor,
                num_steps: int | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Loss of one batch, averaged over ``num_steps`` unrolled steps (default ``cfg.unroll_steps``).

    Returns ``(loss, per-step stats)`` with each step's ``hidden_loss``, ``ce``, ``loss``, ``top1``
    (sums over positions, for exact averaging) and ``count``.
    """
    steps = num_steps or cfg.unroll_steps
    b, t, _ = batch.hidden_states.shape
    total, stats = 0.0, []
    prev = batch.aux_hidden_states if head.variant == "eagle3" else batch.hidden_states
    ttt: list = []   # the keys / values of the steps so far (training-time test)
    for j in range(steps):
        n = t - 1 - j
        if n <= 0:
            break
        inputs = prev[:, :n]
        if j == 0 and head.training:   # the target's features; later steps read the head's own
            inputs = add_feature_noise(inputs, cfg.feature_noise, head.config.hidden_size)
        positions = torch.arange(j, t - 1, device=inputs.device).expand(b, n)   # of the input hidden states
        pred = head(inputs, batch.input_ids[:, 1 + j:], positions, ttt=ttt)   # [B, n, H]
        valid = batch.mask[:, 1 + j:]
        rows = valid.reshape(-1)
        p = pred.reshape(-1, pred.shape[-1])[rows]
        if cfg.hidden_loss_weight:
            hidden_loss = F.smooth_l1_loss(p, batch.hidden_states[:, 1 + j:].reshape(-1, p.shape[-1])[rows],
                                           reduction="none").mean(-1)
        else:
            hidden_loss = p.new_zeros(p.shape[0])
        ids = batch.topk_ids[:, 1 + j:].reshape(-1, batch.topk_ids.shape[-1])[rows]
        probs = batch.topk_probs[:, 1 + j:].reshape(-1, batch.topk_probs.shape[-1])[rows]
        ce, top = chunked_ce(head, p, ids, probs, target_to_draft)
        loss = cfg.hidden_loss_weight * hidden_loss + cfg.ce_weight * ce
        total = total + loss.mean()
        stats.append({"hidden_loss": hidden_loss.sum().item(), "ce": ce.sum().item(), "loss": loss.sum().item(),
                      "top1": (top == ids[:, 0]).sum().item(), "count": int(rows.sum())})
        prev = pred
    return total / max(len(stats), 1), stats


class HeadLoss(torch.nn.Module):
    """The whole unrolled loss as one module, so DistributedDataParallel sees one forward per
    backward however many times the head runs inside it."""

    def __init__(self, head: DraftHead, cfg: TrainConfig, target_to_draft: torch.Tensor):
        super().__init__()
        self.head, self.cfg, self.target_to_draft = head, cfg, target_to_draft

    def forward(self, hidden_states, input_ids, topk_ids, topk_probs, mask, aux_hidden_states=None):
        return head_losses(self.head, Batch(hidden_states, input_ids, topk_ids, topk_probs, mask, aux_hidden_states),
                           self.cfg, self.target_to_draft)


@torch.no_grad()
def evaluate(head: DraftHead, data: HiddenStateDataset, cfg: TrainConfig, target_to_draft: torch.Tensor,
             chain: int | None = None, max_segments: int | None = None) -> dict:
    """Validation metrics over (up to ``max_segments``) segments: loss, hidden_loss, ce and top-1
    of the first step, and ``chain_top1[j]``: top-1 accuracy j+1 positions ahead with the head
    fed its own hidden states (j = 0 .. chain-1)."""
    chain = chain or cfg.eval_chain
    n = min(len(data), max_segments or len(data))
    sums = [dict(hidden_loss=0.0, ce=0.0, loss=0.0, top1=0, count=0) for _ in range(chain)]
    was_training = head.training
    head.eval()
    for s in range(0, n, cfg.batch_size):
        batch = data.batch(list(range(s, min(n, s + cfg.batch_size))), cfg.length_multiple).to(target_to_draft.device)
        with autocast(cfg, target_to_draft.device):
            _, stats = head_losses(head, batch, cfg, target_to_draft, num_steps=chain)
        for acc, st in zip(sums, stats):
            for k in acc:
                acc[k] += st[k]
    head.train(was_training)
    first = sums[0]
    c = max(first["count"], 1)
    return {"loss": first["loss"] / c, "hidden_loss": first["hidden_loss"] / c, "ce": first["ce"] / c,
            "top1": first["top1"] / c, "chain_top1": [a["top1"] / max(a["count"], 1) for a in sums],
            "tokens": first["count"]}


def unigram_top1(train: HiddenStateDataset, val: HiddenStateDataset, vocab_size: int) -> float:
    """Top-1 accuracy on ``val`` of always predicting the training split's most frequent next token."""
    best = int(train.token_counts(vocab_size).argmax())
    hits = total = 0
    for s in val.segments:
        nxt = s["topk_ids"][1:, 0]
        hits += int((nxt == best).sum())
        total += nxt.numel()
    return hits / max(total, 1)


CHECKPOINT_NAME = "checkpoint.pt"
# settings that leave the weights alone: a checkpoint resumes a run that differs only in these
_NOT_TRAJECTORY = ("eval_every", "eval_chain", "max_eval_segments", "save_dtype", "checkpoint_every")


def _trajectory(cfg: TrainConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in _NOT_TRAJECTORY}


def _read_checkpoint(path: Path, cfg: TrainConfig, data: dict) -> dict | None:
    """The checkpoint at ``path`` if there is one, checked to belong to this run.

    Raises:
        ValueError: it was written by a run with other settings or other data (names them).
    """
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    mine = {**_trajectory(cfg), **data}
    theirs = {**state["train_config"], **state["data"]}
    diffs = [f"{k} {theirs.get(k)!r} there, {v!r} now" for k, v in mine.items() if theirs.get(k) != v]
    if diffs:
        raise ValueError(f"{path} is the checkpoint of a run with other settings or data ({'; '.join(diffs)}): "
                         f"delete it to start afresh, or write this run to another folder")
    return state


def _write_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)   # a kill while writing leaves the previous checkpoint whole


def return_freed_memory_to_the_os(threshold: int = 64 * 1024) -> bool:
    """Serve host allocations of ``threshold`` bytes or more with their own mappings, unmapped when
    freed, and trim the heap top past it (glibc's ``mallopt`` ``M_MMAP_THRESHOLD`` and
    ``M_TRIM_THRESHOLD``; what ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set).

    Why: by default glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB),
    after which a training step's activations of a few MiB come from the heap, whose free pieces of
    varying sizes it never returns. The 500k-token run of docs/history/benchmarks-before-packing.md ("Piece 4") grew to 21.8 GB
    resident by step 600 without this. The setting is process-wide (it stays after training).

    Returns:
        True when both were set; False where the C library has no ``mallopt`` (not glibc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3   # <malloc.h>
    return bool(mallopt(m_mmap_threshold, threshold)) and bool(mallopt(m_trim_threshold, threshold))


def _dist_info() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if world > 1 else (0, 1)


def train_head(data_dir: str | Path, out_dir: str | Path, target_config, embed_weight: torch.Tensor,
               lm_head_weight: torch.Tensor, cfg: TrainConfig, device: str = "cpu",
               progress: bool = True, stop_at_step: int | None = None,
               target_layer: dict[str, torch.Tensor] | None = None) -> tuple[dict, DraftHead]:
    """Train a head on the hidden states in ``data_dir``; write it to ``out_dir``. Resumes from
    ``out_dir/checkpoint.pt`` when a run with the same settings left one there. Under torchrun
    (``WORLD_SIZE`` > 1) it joins the default process group, creating it when needed; the caller
    ends it (``torch.distributed.destroy_process_group()``) before the process exits, else gloo's
    threads can abort the exit ("terminate called without an active exception").

    Args:
        target_config: the target's :class:`~specserve.config.ModelConfig` (the head's shape).
        embed_weight, lm_head_weight: the target's ``[V, H]`` embedding and lm_head (frozen).
        target_layer: with ``cfg.init_from_target``, the target's last decoder layer's tensors by
            name without the layer prefix (:meth:`DraftHead.init_from_target_layer`).
        stop_at_step: stop after this many steps (of ``cfg.num_steps``) with a checkpoint and no
            head written: one piece of a long run; a rerun goes on.
    Returns:
        ``(summary, head)``: the summary (also ``out_dir/train_summary.json``) holds settings,
        tokens seen, seconds (of all pieces), the steps it resumed at, the unigram baseline and
        the validation metrics before and after (``complete`` False and no ``val_after`` when
        stopped at ``stop_at_step``). ``out_dir/train_log.jsonl`` holds a line per step.
    Raises:
        ValueError: the data was made by another target (hidden size or vocabulary differ), or
            ``out_dir`` holds the checkpoint of a run with other settings or data.
    """
    if stop_at_step is not None and stop_at_step < 1:
        raise ValueError(f"stop_at_step must be >= 1, got {stop_at_step}")
    rank, world = _dist_info()
    return_freed_memory_to_the_os()   # before the data: a long run's heap otherwise only grows
    torch.manual_seed(cfg.seed)
    eagle3 = cfg.variant == "eagle3"
    train = HiddenStateDataset(data_dir, "train", cfg.val_fraction, cfg.max_train_tokens, load_aux=eagle3)
    val = HiddenStateDataset(data_dir, "validation", cfg.val_fraction, load_aux=eagle3)
    st = train.settings
    if st["hidden_size"] != target_config.hidden_size or st["vocab_size"] != target_config.vocab_size:
        raise ValueError(f"{data_dir} was precomputed for {st['target']} (hidden {st['hidden_size']}, "
                         f"vocab {st['vocab_size']}), not this target")
    head_cfg = DraftHeadConfig.for_target(target_config, cfg.variant, cfg.intermediate_size, cfg.draft_vocab_size,
                                          aux_hidden_state_layers=tuple(st.get("aux_layers", ())),
                                          own_lm_head=cfg.own_lm_head)
    head = DraftHead(head_cfg)
    if cfg.init_from_target:
        if target_layer is None:
            raise ValueError("init_from_target needs the target's last decoder layer (target_layer)")
        head.init_from_target_layer(target_layer)
    if cfg.draft_vocab_size is not None:
        head.set_draft_vocab(frequent_token_vocab(train.token_counts(target_config.vocab_size), cfg.draft_vocab_size))
    head.to(device).attach_target(embed_weight.to(device, torch.float32), lm_head_weight.to(device, torch.float32))
    if cfg.own_lm_head:
        head.init_own_lm_head()
    target_to_draft = head.target_to_draft()
    model = HeadLoss(head, cfg, target_to_draft)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    out = Path(out_dir)
    data_key = {"target": st["target"], "train_tokens": train.num_tokens, "train_segments": len(train),
                "val_tokens": val.num_tokens, "world_size": world}
    state = _read_checkpoint(out / CHECKPOINT_NAME, cfg, data_key)
    start = 0 if state is None else state["step"]
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
    log_file = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / "train_log.jsonl"
        kept = []   # the log up to the checkpoint; steps after it are redone
        if state is not None and log_path.is_file():
            kept = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= start]
        log_file = open(log_path, "w")
        log_file.writelines(line + "\n" for line in kept)
        per_step = cfg.batch_size * world * train.num_tokens / len(train)
        print(f"training a {cfg.variant} head: {cfg.num_steps} steps x ~{per_step:,.0f} tokens = "
              f"{cfg.num_steps * per_step / train.num_tokens:.1f} epochs of {train.num_tokens:,} training tokens "
              f"({val.num_tokens:,} validation), {cfg.unroll_steps} unrolled step(s)"
              + (f"; resuming at step {start}" if start else ""), flush=True)
    baseline = unigram_top1(train, val, target_config.vocab_size)
    before = evaluate(head, val, cfg, target_to_draft) if state is None else state["val_before"]
    rng = random.Random(cfg.seed)
    order: list[int] = []
    tokens_seen, seconds_before = 0, 0.0
    resumed_at = []
    if state is not None:
        rng.setstate(state["rng"])
        order, tokens_seen, seconds_before = state["order"], state["tokens_seen"], state["seconds"]
        resumed_at = state["resumed_at"] + [start]
    t0 = time.perf_counter()
    end = cfg.num_steps if stop_at_step is None else min(cfg.num_steps, stop_at_step)

    def checkpoint_state(step: int) -> dict:
        return {"step": step, "train_config": _trajectory(cfg), "data": data_key, "head": head.state_dict(),
                "optimizer": opt.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                "order": order, "tokens_seen": tokens_seen, "seconds": seconds_before + time.perf_counter() - t0,
                "val_before": before, "resumed_at": resumed_at}

    bar = tqdm(range(start, end), desc=f"train {cfg.variant} head", total=cfg.num_steps, initial=start,
               disable=not progress or rank != 0)
    for step in bar:
        need = cfg.batch_size * world
        if len(order) < need:
            epoch = list(range(len(train)))
            rng.shuffle(epoch)
            order += epoch * max(1, -(-need // len(epoch)))
        mine, order = order[:need][rank::world], order[need:]
        batch = train.batch(mine, cfg.length_multiple).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with autocast(cfg, device):
            loss, stats = model(batch.hidden_states, batch.input_ids, batch.topk_ids, batch.topk_probs, batch.mask,
                                batch.aux_hidden_states)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.max_grad_norm)
        opt.step()
        tokens_seen += stats[0]["count"] * world
        c = max(stats[0]["count"], 1)
        rec = {"step": step + 1, "lr": lr_at(step, cfg), "loss": loss.item(), "hidden_loss": stats[0]["hidden_loss"] / c,
               "ce": stats[0]["ce"] / c, "top1": stats[0]["top1"] / c, "grad_norm": float(grad_norm),
               "tokens": tokens_seen, "seconds": seconds_before + time.perf_counter() - t0}   # before the evaluation
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.num_steps:
            rec["val"] = evaluate(head, val, cfg, target_to_draft, max_segments=cfg.max_eval_segments)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", top1=f"{rec['top1']:.2f}")
        if log_file is not None:
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
        periodic = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
        if rank == 0 and step + 1 < cfg.num_steps and (periodic or step + 1 == end):
            _write_checkpoint(out / CHECKPOINT_NAME, checkpoint_state(step + 1))
    seconds = seconds_before + time.perf_counter() - t0
    summary = {"target": st["target"], "train_config": asdict(cfg), "head_config": asdict(head_cfg),
               "world_size": world, "train_tokens": train.num_tokens, "val_tokens": val.num_tokens,
               "tokens_seen": tokens_seen, "seconds": seconds, "resumed_at": resumed_at,
               "unigram_top1": baseline, "val_before": before, "complete": end == cfg.num_steps}
    if end < cfg.num_steps:   # one piece of the run: the checkpoint holds it
        if log_file is not None:
            log_file.close()
        return summary, head
    summary["val_after"] = evaluate(head, val, cfg, target_to_draft)
    if rank == 0:
        log_file.close()
        head.save(out, dtype=getattr(torch, cfg.save_dtype))
        write_json(out / "train_summary.json", summary)
        (out / CHECKPOINT_NAME).unlink(missing_ok=True)
    if world > 1:
        dist.barrier()
    return summary, head
