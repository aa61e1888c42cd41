"""One-layer draft heads that predict the target's next hidden state: EAGLE-3, EAGLE and the normed MTP head.

A head reads, for position t, target features at t and the embedding of token t+1, and returns a
hidden state for position t+1 that an lm_head turns into next-token logits. While drafting a chain
it reads its own previous output instead of the target's features. Three variants:

* ``eagle3`` (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
  via Training-Time Test", section 3): the target's features are the residual streams
  entering a low, a middle and a high layer, fused by ``fc`` (``[3H] -> [H]``, no bias). One decoder
  layer whose attention reads ``concat(input_layernorm(embed), hidden_norm(h))`` (``2H`` wide),
  with ``h`` as the residual; ``norm`` then an lm_head score the output. The output, before
  ``norm``, is what the next draft step reads. Trained on tokens only (no feature regression) and
  on its own unrolled predictions ("training-time test"). Its lm_head is its own when
  ``own_lm_head`` (EAGLE-3's checkpoints), else the target's rows, frozen.
* ``eagle`` (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", section 4.1): ``fc(concat(embed, h))`` with a bias, ``h`` the target's final-norm
  output, then one decoder layer whose input RMSNorm is removed, and no final norm.
* ``normed`` (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2, the MTP module; the
  seed's fix): ``eh_proj(concat(enorm(embed), hnorm(h)))``, a standard pre-norm decoder layer and a
  final RMSNorm (``shared_head.norm``) before the shared lm_head, so the head's output lives in the
  normalized space the target's lm_head was trained on.

The decoder layer is shaped like the target's (width, heads, RoPE); only the MLP's intermediate
size is free. The target's embedding and lm_head are attached with :meth:`DraftHead.attach_target`:
frozen, shared with the target and never saved. A reduced draft vocabulary (EAGLE-3, section 3)
scores only ``draft_vocab_size`` target tokens, mapped by ``draft_to_target``.

Checkpoints are written in the layouts vLLM and SGLang load, with a Hugging Face style
``config.json``: EAGLE-3's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and
EAGLE's (``fc.*``, ``layers.0.*``, and for ``normed`` ``enorm``/``hnorm``/``norm``).
:func:`load_draft_head` also maps DeepSeek-V3 MTP names (``model.layers.{N}.eh_proj`` ...) and
reports what it cannot map.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.metadata import AttentionMetadata
from specserve.attention.cpu_backend import CpuAttentionBackend
from specserve.config import ModelConfig
from specserve.models.llama import RotaryEmbedding, rms_norm

HEAD_VARIANTS = ("eagle3", "eagle", "normed")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class DraftHeadConfig:
    """Shape of a draft head. Width, attention shape and RoPE follow the target.

    Attributes:
        variant: ``"eagle"`` or ``"normed"``.
        vocab_size: the target's vocabulary size.
        draft_vocab_size: tokens the head scores (None: the whole target vocabulary).
        target_architecture: the target's ``ModelConfig.architecture`` ("llama" | "qwen2").
        aux_hidden_state_layers: ``eagle3``: the target layers whose input residual stream ``fc``
            fuses (empty: EAGLE-3's default (2, L // 2, L - 3), filled in for the target).
        own_lm_head: ``eagle3``: the head has its own ``lm_head [draft vocab, H]`` (trained, saved)
            instead of the target's rows.
    """

    variant: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    draft_vocab_size: int | None = None
    target_architecture: str = "llama"
    aux_hidden_state_layers: tuple[int, ...] = ()
    own_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.variant not in HEAD_VARIANTS:
            raise ValueError(f"variant must be one of {HEAD_VARIANTS}, got {self.variant!r}")
        self.aux_hidden_state_layers = tuple(int(i) for i in self.aux_hidden_state_layers)
        if self.variant != "eagle3" and (self.aux_hidden_state_layers or self.own_lm_head):
            raise ValueError(f"aux_hidden_state_layers and own_lm_head are for variant 'eagle3', not {self.variant!r}")
        if self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    @classmethod
    def for_target(cls, target: ModelConfig, variant: str, intermediate_size: int | None = None,
                   draft_vocab_size: int | None = None, aux_hidden_state_layers: tuple[int, ...] | None = None,
                   own_lm_head: bool = False) -> "DraftHeadConfig":
        """A head for ``target``; the MLP is as wide as the target's unless ``intermediate_size``;
        an ``eagle3`` head fuses ``aux_hidden_state_layers`` (default: EAGLE-3's three)."""
        aux = ()
        if variant == "eagle3":
            aux = tuple(aux_hidden_state_layers or default_aux_layers(target.num_hidden_layers))
        return cls(variant=variant, hidden_size=target.hidden_size,
                   intermediate_size=intermediate_size or target.intermediate_size,
                   num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                   head_dim=target.head_dim, vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
                   attention_bias=target.attention_bias, draft_vocab_size=draft_vocab_size,
                   target_architecture=target.architecture, aux_hidden_state_layers=aux, own_lm_head=own_lm_head)

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_hidden_state_layers)

    def to_hf_dict(self) -> dict:
        """``config.json`` contents: the target's Hugging Face fields with one layer, EAGLE's
        architecture name, and our own fields under ``specserve_head``."""
        extra = {}
        if self.variant == "eagle3":   # what vLLM and SGLang read to feed an EAGLE-3 head
            arch = "LlamaForCausalLMEagle3"   # their EAGLE-3 class for every target
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_hidden_state_layers),
                                     "use_aux_hidden_state": True}
            extra["target_hidden_size"] = self.hidden_size
        else:
            arch = "Qwen2ForCausalLMEagle" if self.target_architecture == "qwen2" else "LlamaForCausalLMEagle"
        return {
            "architectures": [arch],
            "model_type": self.target_architecture,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "attention_bias": self.attention_bias, "torch_dtype": "float16", **extra,
            "specserve_head": asdict(self),
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DraftHeadConfig":
        """Inverse of :meth:`to_hf_dict`. A foreign config (no ``specserve_head``) is read from
        its Hugging Face fields: ``eagle3`` when its architecture says Eagle3 or it has an
        ``eagle_config`` (its own lm_head; fused layers from ``eagle_aux_hidden_state_layer_ids``,
        else EAGLE-3's default, filled in for the target), else ``eagle``."""
        if "specserve_head" in d:
            names = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in d["specserve_head"].items() if k in names})
        heads = d["num_attention_heads"]
        draft_vocab = d.get("draft_vocab_size")
        eagle3 = "eagle_config" in d or any("Eagle3" in a for a in d.get("architectures", []))
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
        bias_default = False if eagle3 else d.get("model_type") == "qwen2"
        return cls(variant="eagle3" if eagle3 else "eagle", hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d.get("max_position_embeddings", 2048),
                   attention_bias=d.get("attention_bias", bias_default),
                   draft_vocab_size=None if draft_vocab in (None, d["vocab_size"]) else draft_vocab,
                   target_architecture=d.get("model_type", "llama"), aux_hidden_state_layers=tuple(aux),
                   own_lm_head=eagle3)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high target layers, as vLLM and SGLang pick them:
    (2, L // 2, L - 3), clipped and deduplicated for shallow models."""
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)}))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        w = 2 * h if cfg.variant == "eagle3" else h   # eagle3 reads [normed embedding, normed hidden state]
        self.q_proj = nn.Linear(w, q, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(w, kv, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(w, kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class PagedKV:
    """Where the head's keys/values live at inference: one layer's paged caches and the batch's
    metadata (see :class:`~specserve.attention.torch_backend.TorchAttentionBackend`)."""

    key_cache: torch.Tensor     # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    md: AttentionMetadata


def _training_time_test_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention of unrolled step j >= 1 as the head sees it when drafting (EAGLE-3, section 3,
    "training-time test").

    Row r of step j is the j-th draft after the accepted position r. At inference its query sees
    the entries made from the target's features at positions <= r (step 0's keys, causal) and the
    chain's own entries at r+1 .. r+j, which are row r of steps 1 .. j (this step's included).

    Args:
        q, k, v: ``[B, heads, n, D]`` / ``[B, kv_heads, n, D]`` this step's (n rows).
        earlier: ``(k, v)`` of steps 0 .. j-1, each with at least n rows.
    Returns:
        ``[B, heads, n, D]``.
    """
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    expand = (lambda t: t.repeat_interleave(group, dim=1)) if group > 1 else (lambda t: t)
    scale = d ** -0.5
    k0, v0 = (expand(t[:, :, :n]) for t in earlier[0])
    scores0 = (q @ k0.transpose(-1, -2)) * scale                                 # [B, hq, n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores0 = scores0.masked_fill(~causal, float("-inf"))
    diag_k = [expand(kk[:, :, :n]) for kk, _ in earlier[1:]] + [expand(k)]
    diag_v = [expand(vv[:, :, :n]) for _, vv in earlier[1:]] + [expand(v)]
    diag = torch.stack([(q * kk).sum(-1) for kk in diag_k], dim=-1) * scale     # [B, hq, n, j]
    p = torch.softmax(torch.cat([scores0, diag], dim=-1), dim=-1)
    out = p[..., :n] @ v0
    return out + (p[..., n:].unsqueeze(-1) * torch.stack(diag_v, dim=-2)).sum(-2)


class DraftHead(nn.Module):
    """A one-layer EAGLE / MTP draft head (see the module docstring for the two variants).

    Parameter names follow EAGLE-3 (``fc``, ``hidden_norm``, ``norm``, ``lm_head``), DeepSeek-V3's
    MTP module (``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``) and a Hugging Face decoder
    layer (``self_attn.*``, ``mlp.*``).
    """

    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.variant = config.variant
        self.normed = config.variant == "normed"
        n = config.draft_vocab_size or config.vocab_size
        if self.variant == "eagle3":
            self.fc = nn.Linear(max(config.num_aux_layers, 1) * h, h, bias=False)
            self.input_layernorm = RMSNorm(h, eps)   # of the embedding
            self.hidden_norm = RMSNorm(h, eps)
            self.norm = RMSNorm(h, eps)
            if config.own_lm_head:
                self.lm_head = nn.Linear(h, n, bias=False)
        else:
            # EAGLE's fc carries a bias; DeepSeek's eh_proj, behind two norms, does not
            self.eh_proj = nn.Linear(2 * h, h, bias=not self.normed)
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if self.normed:
            self.enorm = RMSNorm(h, eps)
            self.hnorm = RMSNorm(h, eps)
            self.input_layernorm = RMSNorm(h, eps)
            self.shared_head = nn.Module()
            self.shared_head.norm = RMSNorm(h, eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, max(config.max_position_embeddings, 1))
        self.paged_attention = CpuAttentionBackend(config.num_attention_heads, config.num_key_value_heads,
                                                   config.head_dim)
        self.register_buffer("draft_to_target", torch.arange(n, dtype=torch.int64))
        # the target's, frozen: plain attributes, so they are neither saved, trained, moved by
        # .to() nor broadcast by DistributedDataParallel
        self.embed_weight: torch.Tensor | None = None     # [V, H]
        self.lm_head_weight: torch.Tensor | None = None   # [N, H] the draft vocabulary's rows
        self._full_lm_head: torch.Tensor | None = None    # [V, H]
        self.quantized_lm_head: nn.Module | None = None   # inference: the rows on our integer kernels
        self.quantization = "none"

    # ------------------------------------------------------------------ target parts
    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                      keep_full_lm_head: bool = True) -> "DraftHead":
        """Share the target's token embedding ``[V, H]`` and lm_head ``[V, H]`` (frozen, not saved).
        With a reduced vocabulary only the ``draft_to_target`` rows of the lm_head are used; the
        whole one is kept only if ``keep_full_lm_head`` (to change the vocabulary later).

        Raises:
            ValueError: a weight whose shape is not the head's ``(vocab_size, hidden_size)``.
        """
        v, h = self.config.vocab_size, self.config.hidden_size
        for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != (v, h):
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, the head expects {(v, h)}")
        self.embed_weight = embed_weight.detach()
        full = lm_head_weight.detach()
        if self.config.draft_vocab_size is None:
            self.lm_head_weight = full
        else:
            self.lm_head_weight = full.index_select(0, self.draft_to_target.to(full.device))
        self._full_lm_head = full if keep_full_lm_head else None
        return self

    def init_own_lm_head(self) -> None:
        """Start an own lm_head (``own_lm_head``) from the target's rows of the draft vocabulary
        (call after :meth:`attach_target` and :meth:`set_draft_vocab`, before training)."""
        if not self.config.own_lm_head or self.lm_head_weight is None:
            raise RuntimeError("init_own_lm_head needs own_lm_head and an attached target")
        with torch.no_grad():
            self.lm_head.weight.copy_(self.lm_head_weight.to(self.lm_head.weight.dtype))

    def init_from_target_layer(self, layer: dict[str, torch.Tensor]) -> None:
        """Start the decoder layer from one of the target's (its last, typically) instead of at
        random, so that training starts from a layer that already maps the target's features to
        features its lm_head reads. Call before training.

        ``layer``: the target layer's tensors by Hugging Face name without the layer prefix
        (``self_attn.q_proj.weight``, ``mlp.down_proj.weight``, ``input_layernorm.weight`` ...).
        Copied: attention (q / k / v weights and biases, o_proj), ``post_attention_layernorm``
        and the input norm (eagle3: ``hidden_norm``; normed: ``input_layernorm``). eagle3's q / k
        / v read ``[embedding, hidden]``: the hidden half is the target's, the embedding half
        starts at zero. An MLP narrower than the target's keeps the target's channels of largest
        ``|up row| x |down column|``. The input projection starts as a pass-through of the
        features: eagle3's ``fc`` picks the highest fused layer, ``eh_proj`` the hidden half.

        Raises:
            ValueError: a tensor is missing or its shape does not fit this head (naming it).
        """
        h = self.config.hidden_size

        def get(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            if name not in layer:
                raise ValueError(f"init_from_target_layer: the target layer has no {name!r}")
            t = layer[name].detach().float()
            if shape is not None and tuple(t.shape) != tuple(shape):
                raise ValueError(f"init_from_target_layer: {name!r} is {tuple(t.shape)}, this head needs {tuple(shape)}")
            return t

        attn, eagle3 = self.self_attn, self.variant == "eagle3"
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(attn, name)
                w = get(f"self_attn.{name}.weight", (lin.out_features, h))
                if eagle3:
                    lin.weight.zero_()
                    lin.weight[:, h:].copy_(w)
                else:
                    lin.weight.copy_(w)
                if lin.bias is not None:
                    lin.bias.copy_(get(f"self_attn.{name}.bias", (lin.out_features,)))
            attn.o_proj.weight.copy_(get("self_attn.o_proj.weight", tuple(attn.o_proj.weight.shape)))
            self.post_attention_layernorm.weight.copy_(get("post_attention_layernorm.weight", (h,)))
            if eagle3 or self.normed:
                norm = self.hidden_norm if eagle3 else self.input_layernorm
                norm.weight.copy_(get("input_layernorm.weight", (h,)))
            gate, width = get("mlp.gate_proj.weight"), self.config.intermediate_size
            if gate.ndim != 2 or gate.shape[1] != h or gate.shape[0] < width:
                raise ValueError(f"init_from_target_layer: the target's MLP {tuple(gate.shape)} cannot start "
                                 f"this head's {width} channels")
            up, down = get("mlp.up_proj.weight", tuple(gate.shape)), get("mlp.down_proj.weight", (h, gate.shape[0]))
            keep = (up.norm(dim=1) * down.norm(dim=0)).topk(width).indices.sort().values
            self.mlp.gate_proj.weight.copy_(gate[keep])
            self.mlp.up_proj.weight.copy_(up[keep])
            self.mlp.down_proj.weight.copy_(down[:, keep])
            proj = self.fc if eagle3 else self.eh_proj
            proj.weight.zero_()
            proj.weight[:, -h:].copy_(torch.eye(h))
            if proj.bias is not None:
                proj.bias.zero_()

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install the reduced vocabulary: ``draft_to_target [N]`` int64 distinct target ids."""
        n = self.config.draft_vocab_size or self.config.vocab_size
        ids = torch.as_tensor(draft_to_target, dtype=torch.int64)
        if ids.shape != (n,) or ids.unique().numel() != n or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"draft_to_target must hold {n} distinct target ids in [0, {self.config.vocab_size})")
        self.draft_to_target.copy_(ids)
        if self._full_lm_head is not None:
            self.lm_head_weight = self._full_lm_head.index_select(0, ids.to(self._full_lm_head.device))

    def target_to_draft(self) -> torch.Tensor:
        """``[V]`` int64: each target token's index in the draft vocabulary, -1 where it has none."""
        out = torch.full((self.config.vocab_size,), -1, dtype=torch.int64, device=self.draft_to_target.device)
        out[self.draft_to_target] = torch.arange(self.draft_to_target.numel(), device=out.device)
        return out

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("attach_target() first: the head shares the target's embedding")
        return F.embedding(token_ids, self.embed_weight)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                kv: PagedKV | None = None, ttt: "list[tuple[torch.Tensor, torch.Tensor]] | None" = None) -> torch.Tensor:
        """Predict the next hidden states.

        Args:
            hidden_states: ``[..., T, W]`` what the head reads at each position t: the target's
                features, or (``W = H``) the head's own previous output. For ``eagle3`` the target's
                features are ``[n_aux * H]`` (the fused layers) or ``[(1 + n_aux) * H]`` (the target
                model's output with auxiliary layers: final hidden state first, skipped here).
            input_ids: ``[..., T]`` int64, token t+1 for each position (the token the hidden state
                predicted).
            positions: ``[..., T]`` int64, the position t of each input hidden state (the
                head's KV entry for the pair lives at t; RoPE makes only differences matter).
            kv: None for training: ``[B, T, H]`` batches attend causally within each row (padding
                at the end of a row cannot reach earlier positions). At inference ``[T, H]`` rows of
                several sequences with their paged caches.
            ttt: training only: the keys / values of the earlier unrolled steps of this batch
                (EAGLE-3's training-time test, see :meth:`_attention`); this step's are appended.
        Returns:
            ``[..., T, H]`` predicted hidden states: what the next draft step reads and what
            :meth:`compute_logits` scores.
        """
        embeds = self.embed(input_ids).to(hidden_states.dtype)
        if self.variant == "eagle3":
            h = self.config.hidden_size
            if hidden_states.shape[-1] == (1 + self.config.num_aux_layers) * h and self.config.num_aux_layers:
                hidden_states = hidden_states[..., h:]
            if hidden_states.shape[-1] != h:
                hidden_states = self.fc(hidden_states)
            residual = hidden_states
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
            x = residual + self._attention(x, positions, kv, ttt)
            return x + self.mlp(self.post_attention_layernorm(x))
        if self.normed:
            embeds, hidden_states = self.enorm(embeds), self.hnorm(hidden_states)
        x = self.eh_proj(torch.cat([embeds, hidden_states], dim=-1))
        residual = x
        if self.normed:
            x = self.input_layernorm(x)
        x = residual + self._attention(x, positions, kv, ttt)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x) if self.normed else x

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKV | None,
                   ttt: "list[tuple[torch.Tensor, torch.Tensor]] | None" = None) -> torch.Tensor:
        cfg = self.config
        lead = x.shape[:-1]
        q = self.self_attn.q_proj(x).reshape(-1, cfg.num_attention_heads, cfg.head_dim)
        k = self.self_attn.k_proj(x).reshape(-1, cfg.num_key_value_heads, cfg.head_dim)
        v = self.self_attn.v_proj(x).reshape(-1, cfg.num_key_value_heads, cfg.head_dim)
        q, k = self.rotary(positions.reshape(-1), q, k)
        if kv is None:
            b, t = (1, lead[0]) if len(lead) == 1 else lead
            qb, kb, vb = (z.reshape(b, t, -1, cfg.head_dim).transpose(1, 2) for z in (q, k, v))
            if ttt:
                out = _training_time_test_attention(qb, kb, vb, ttt)
            else:
                out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                     enable_gqa=cfg.num_attention_heads != cfg.num_key_value_heads)
            if ttt is not None:
                ttt.append((kb, vb))
            out = out.transpose(1, 2).reshape(*lead, -1)
        else:
            out = self.paged_attention.forward(q, k, v, kv.key_cache, kv.value_cache, kv.md).reshape(*lead, -1)
        return self.self_attn.o_proj(out)

    def compute_logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., N]`` float32 logits over the draft vocabulary (N = V when full);
        map an index to a target token id with ``draft_to_target``."""
        if self.variant == "eagle3":
            head_hidden = self.norm(head_hidden)
            if self.config.own_lm_head:
                return self.lm_head(head_hidden).float()
        if self.quantized_lm_head is not None:
            lead = head_hidden.shape[:-1]
            return self.quantized_lm_head(head_hidden.reshape(-1, head_hidden.shape[-1])).reshape(*lead, -1)
        if self.lm_head_weight is None:
            raise RuntimeError("attach_target() first: the head shares the target's lm_head")
        return F.linear(head_hidden, self.lm_head_weight.to(head_hidden.dtype)).float()

    # ------------------------------------------------------------------ inference layout
    @property
    def dtype(self) -> torch.dtype:
        """The float dtype of the head's activations and KV cache (its norms' weights)."""
        return self.post_attention_layernorm.weight.dtype

    def linear_names(self) -> list[str]:
        """The qualified names of the head's linear modules (``fc``, attention, MLP, own lm_head)."""
        return [n for n, m in self.named_modules() if isinstance(m, nn.Linear)]

    def quantize_(self, quantization: str, target_lm_head=None) -> "DraftHead":
        """Inference only, in place: every linear on our batch-invariant int8 / int4 kernels
        (:func:`~specserve.models.linear.make_linear`), so a draft token reads about a quarter (int8)
        or an eighth (int4) of the float32 bytes; drafting at batch 1 is bound by those bytes.

        A draft's numerics change which tokens are proposed, never which are emitted (the target
        verifies each one), so this is lossless. Call after :meth:`attach_target` and the vocabulary
        is set; the head can no longer be trained or saved.

        Args:
            quantization: ``"none"`` (no change), ``"int8"`` or ``"int4"``.
            target_lm_head: the target's lm_head as it is stored
                (:class:`~specserve.models.quantization.QuantizedTensor` ``[V, H]``): its draft
                vocabulary rows are kept in the target's own blocks instead of being re-quantized
                from the float copy. None: quantize ``lm_head_weight``.
        Raises:
            ValueError: an unknown quantization, or a shape the layout cannot pack (named).
        """
        from specserve.models.linear import make_linear
        from specserve.models.quantization import QuantizedTensor, check_quantization

        quantization = check_quantization(quantization)
        if quantization == "none":
            return self
        for name in self.linear_names():
            parent_name, _, attr = name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            lin = getattr(parent, attr)
            bias = None if lin.bias is None else lin.bias.detach().float()
            setattr(parent, attr, make_linear([lin.weight.detach().float()], bias, quantization, name + ".weight"))
        if not self.config.own_lm_head:
            if self.lm_head_weight is None:
                raise RuntimeError("attach_target() first: the head scores with the target's lm_head rows")
            if isinstance(target_lm_head, QuantizedTensor):
                rows = target_lm_head
                if self.config.draft_vocab_size is not None:
                    rows = target_lm_head.select_rows(self.draft_to_target.cpu())
            else:
                rows = self.lm_head_weight.float()
            self.quantized_lm_head = make_linear([rows], None, quantization, "lm_head.weight")
            self.lm_head_weight = None   # the float copy is no longer read
        self.quantization = quantization
        return self

    # ------------------------------------------------------------------ checkpoints
    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under checkpoint names: EAGLE-3's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``)
        for ``eagle3``, EAGLE's (``fc``, ``layers.0.*``, ``norm``) otherwise; ``d2t``/``t2d`` when
        the vocabulary is reduced."""
        out = {}
        for name, t in self.state_dict().items():
            if name == "draft_to_target":
                continue
            out[_to_checkpoint_name(name, self.variant)] = t.detach().contiguous()
        if self.config.draft_vocab_size is not None:
            ids = self.draft_to_target
            out["d2t"] = ids - torch.arange(ids.numel())  # EAGLE-3: target id = draft id + d2t
            t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            out["t2d"] = t2d
        return out

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (EAGLE names, float weights in ``dtype``)."""
        from specserve.models.loader import save_safetensors

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in self.eagle_state_dict().items()}
        save_safetensors(state, out / WEIGHTS_NAME, metadata={"format": "pt"})
        cfg = self.config.to_hf_dict()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        return out


_EAGLE_TOP = {"eh_proj": "fc", "shared_head.norm": "norm", "enorm": "enorm", "hnorm": "hnorm"}
_EAGLE3_TOP = ("fc", "norm", "lm_head")


def target_layer_tensors(weights: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``index``'s tensors of a target's weights (``model.layers.{index}.*``), by name
    without that prefix: what :meth:`DraftHead.init_from_target_layer` reads."""
    prefix = f"model.layers.{index}."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def _to_checkpoint_name(name: str, variant: str) -> str:
    if variant == "eagle3":
        return name if name.split(".", 1)[0] in _EAGLE3_TOP else "midlayer." + name
    for ours, theirs in _EAGLE_TOP.items():
        if name.startswith(ours + "."):
            return theirs + name[len(ours):]
    return "layers.0." + name


_LAYER_PARTS = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj.",
                "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "input_layernorm.",
                "post_attention_layernorm.")
_TARGET_PARTS = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")


def map_checkpoint_names(names: list[str], variant: str = "eagle") -> tuple[dict[str, str], list[str], list[str]]:
    """Map checkpoint tensor names to :class:`DraftHead` parameter names.

    Understands EAGLE-3's layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``; for ``variant``
    ``"eagle3"``), the EAGLE layout (``fc``, ``layers.0.*``, ``norm``, ``enorm``, ``hnorm``) and
    DeepSeek-V3's MTP layout (``model.layers.{N}.eh_proj``, ``enorm``, ``hnorm``,
    ``shared_head.norm``, the decoder layer's ``self_attn``/``mlp``/norms); ``d2t``/``t2d`` in all.
    Returns ``(mapping, target_owned, unmapped)``: checkpoint name -> ours; names that belong to
    the target (embedding, lm_head: the head shares the target's, so they are skipped; an EAGLE-3
    head's own ``lm_head`` is mapped); names with no counterpart here (e.g. DeepSeek's MLA
    attention or MoE experts).
    """
    mapping, target_owned, unmapped = {}, [], []
    for name in names:
        base = re.sub(r"^model\.layers\.\d+\.", "", name)   # DeepSeek MTP: model.layers.{N}.*
        base = re.sub(r"^model\.", "", base)
        for prefix in ("layers.0.", "midlayer."):
            if base.startswith(prefix):
                base = base[len(prefix):]
        if base in ("d2t", "t2d"):
            mapping[name] = base
        elif variant == "eagle3":
            if base.startswith(("fc.", "norm.", "lm_head.", "hidden_norm.")) or base.startswith(_LAYER_PARTS):
                mapping[name] = base
            elif base.endswith(_TARGET_PARTS):
                target_owned.append(name)
            else:
                unmapped.append(name)
        elif base.endswith(_TARGET_PARTS) or base in _TARGET_PARTS:
            target_owned.append(name)
        elif base.startswith(("fc.", "eh_proj.")):
            mapping[name] = "eh_proj." + base.split(".", 1)[1]
        elif base.startswith(("norm.", "shared_head.norm.")):
            mapping[name] = "shared_head.norm." + base.rsplit(".", 1)[1]
        elif base.startswith(("enorm.", "hnorm.")) or base.startswith(_LAYER_PARTS):
            mapping[name] = base
        else:
            unmapped.append(name)
    return mapping, target_owned, unmapped


@dataclass
class LoadReport:
    """What :func:`load_draft_head` did with every tensor of a checkpoint."""

    loaded: list[str]             # our parameter names filled from the checkpoint
    target_owned: list[str]       # checkpoint tensors skipped: the head shares the target's
    unmapped: list[str]           # checkpoint tensors with no counterpart in the head
    missing: list[str]            # head parameters the checkpoint did not provide (left at init)


def load_draft_head(path: str | Path, config: DraftHeadConfig | None = None,
                    strict: bool = True, target_num_layers: int | None = None) -> tuple[DraftHead, LoadReport]:
    """Load a head from a folder with ``config.json`` and ``*.safetensors``.

    Args:
        path: the checkpoint folder (our own, an EAGLE / EAGLE-3 one, or DeepSeek-MTP tensors).
        config: overrides the folder's ``config.json`` (required when it has none).
        strict: raise when a head parameter is missing or a tensor cannot be mapped.
        target_num_layers: the target's depth, for an EAGLE-3 checkpoint that does not name the
            layers it fuses (EAGLE-3's default (2, L // 2, L - 3) is taken).
    Raises:
        FileNotFoundError: no safetensors file, or no config and none given.
        ValueError: a tensor's shape differs from the head's, or (strict) missing/unmapped names,
            or an EAGLE-3 checkpoint without its fused layers and no ``target_num_layers``.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    if config is None:
        cfg_file = folder / CONFIG_NAME
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found; pass a DraftHeadConfig")
        config = DraftHeadConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    if config.variant == "eagle3" and not config.aux_hidden_state_layers:
        if target_num_layers is None:
            raise ValueError(f"EAGLE-3 checkpoint {folder} does not name the target layers it fuses "
                             "(eagle_config.eagle_aux_hidden_state_layer_ids); pass target_num_layers")
        config = replace(config, aux_hidden_state_layers=default_aux_layers(target_num_layers))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    mapping, target_owned, unmapped = map_checkpoint_names(list(tensors), config.variant)
    head = DraftHead(config)
    own = dict(head.state_dict())
    state, loaded = {}, []
    d2t = None
    for src, dst in mapping.items():
        if dst == "d2t":
            d2t = tensors[src].to(torch.int64)
            continue
        if dst == "t2d":
            continue
        if dst not in own:
            unmapped.append(src)   # e.g. a norm the eagle variant has no place for
            continue
        if tuple(tensors[src].shape) != tuple(own[dst].shape):
            raise ValueError(f"{src}: shape {tuple(tensors[src].shape)}, the head's {dst} is {tuple(own[dst].shape)}")
        state[dst] = tensors[src].to(own[dst].dtype)
        loaded.append(dst)
    if d2t is not None:
        state["draft_to_target"] = d2t + torch.arange(d2t.numel())
        loaded.append("draft_to_target")
    missing = [n for n in own if n not in state and n != "draft_to_target"]
    if strict and (missing or unmapped):
        raise ValueError(f"checkpoint {folder}: missing {missing}, cannot map {unmapped}")
    head.load_state_dict(state, strict=False)
    return head, LoadReport(sorted(loaded), target_owned, unmapped, missing)
