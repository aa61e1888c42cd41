"""One-layer draft heads that predict the target's next hidden state: EAGLE and the normed MTP head.

A head reads, for position t, the target's hidden state ``h_t`` (the final-norm output that feeds
the target's lm_head) and the embedding of token t+1, and returns a hidden state for position t+1,
which the target's own frozen lm_head turns into next-token logits. Two variants:

* ``eagle`` (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", section 4.1): ``fc(concat(embed, h))`` with a bias, then one decoder layer whose
  input RMSNorm is removed, and no final norm.
* ``normed`` (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2, the MTP module; the
  seed's fix): ``eh_proj(concat(enorm(embed), hnorm(h)))``, a standard pre-norm decoder layer and a
  final RMSNorm (``shared_head.norm``) before the shared lm_head, so the head's output lives in the
  normalized space the target's lm_head was trained on.

The decoder layer is shaped like the target's (width, heads, RoPE); only the MLP's intermediate
size is free. The target's embedding and lm_head are attached with :meth:`DraftHead.attach_target`:
frozen, shared with the target and never saved. A reduced draft vocabulary (EAGLE-3, Li et al.
2025, section 3) scores only ``draft_vocab_size`` target tokens, mapped by ``draft_to_target``.

Checkpoints are written in the EAGLE layout vLLM and SGLang load (``fc.*``, ``layers.0.*``, and for
``normed`` ``enorm``/``hnorm``/``layers.0.input_layernorm``/``norm``; ``d2t``/``t2d`` as in EAGLE-3
when the vocabulary is reduced) with a Hugging Face style ``config.json``. :func:`load_draft_head`
also maps DeepSeek-V3 MTP names (``model.layers.{N}.eh_proj`` ...) and reports what it cannot map.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.metadata import AttentionMetadata
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.config import ModelConfig
from specserve.models.llama import RotaryEmbedding, rms_norm

HEAD_VARIANTS = ("eagle", "normed")
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

    def __post_init__(self) -> None:
        if self.variant not in HEAD_VARIANTS:
            raise ValueError(f"variant must be one of {HEAD_VARIANTS}, got {self.variant!r}")
        if self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    @classmethod
    def for_target(cls, target: ModelConfig, variant: str, intermediate_size: int | None = None,
                   draft_vocab_size: int | None = None) -> "DraftHeadConfig":
        """A head for ``target``; the MLP is as wide as the target's unless ``intermediate_size``."""
        return cls(variant=variant, hidden_size=target.hidden_size,
                   intermediate_size=intermediate_size or target.intermediate_size,
                   num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                   head_dim=target.head_dim, vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
                   attention_bias=target.attention_bias, draft_vocab_size=draft_vocab_size,
                   target_architecture=target.architecture)

    def to_hf_dict(self) -> dict:
        """``config.json`` contents: the target's Hugging Face fields with one layer, EAGLE's
        architecture name, and our own fields under ``specserve_head``."""
        arch = "Qwen2ForCausalLM" if self.target_architecture == "qwen2" else "LlamaForCausalLM"
        return {
            "architectures": [arch.replace("ForCausalLM", "ForCausalLMEagle")],
            "model_type": self.target_architecture,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "attention_bias": self.attention_bias, "torch_dtype": "float16",
            "specserve_head": asdict(self),
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DraftHeadConfig":
        """Inverse of :meth:`to_hf_dict`; a foreign EAGLE config (no ``specserve_head``) is read
        as the ``eagle`` variant from its Hugging Face fields."""
        if "specserve_head" in d:
            names = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in d["specserve_head"].items() if k in names})
        heads = d["num_attention_heads"]
        draft_vocab = d.get("draft_vocab_size")
        return cls(variant="eagle", hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d.get("max_position_embeddings", 2048),
                   attention_bias=d.get("attention_bias", d.get("model_type") == "qwen2"),
                   draft_vocab_size=None if draft_vocab in (None, d["vocab_size"]) else draft_vocab,
                   target_architecture=d.get("model_type", "llama"))


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
        self.q_proj = nn.Linear(h, q, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, kv, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, kv, bias=cfg.attention_bias)
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


class DraftHead(nn.Module):
    """A one-layer EAGLE / MTP draft head (see the module docstring for the two variants).

    Parameter names follow DeepSeek-V3's MTP module (``eh_proj``, ``enorm``, ``hnorm``,
    ``shared_head.norm``) and a Hugging Face decoder layer (``self_attn.*``, ``mlp.*``).
    """

    def __init__(self, config: DraftHeadConfig):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.normed = config.variant == "normed"
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
        self.paged_attention = TorchAttentionBackend(config.num_attention_heads, config.num_key_value_heads,
                                                     config.head_dim)
        n = config.draft_vocab_size or config.vocab_size
        self.register_buffer("draft_to_target", torch.arange(n, dtype=torch.int64))
        # the target's, frozen: plain attributes, so they are neither saved, trained, moved by
        # .to() nor broadcast by DistributedDataParallel
        self.embed_weight: torch.Tensor | None = None     # [V, H]
        self.lm_head_weight: torch.Tensor | None = None   # [N, H] the draft vocabulary's rows
        self._full_lm_head: torch.Tensor | None = None    # [V, H]

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
                kv: PagedKV | None = None) -> torch.Tensor:
        """Predict the next hidden states.

        Args:
            hidden_states: ``[..., T, H]`` the target's (or the head's own) hidden state at each
                position t.
            input_ids: ``[..., T]`` int64, token t+1 for each position (the token the hidden state
                predicted).
            positions: ``[..., T]`` int64, the position t of each input hidden state (the
                head's KV entry for the pair lives at t; RoPE makes only differences matter).
            kv: None for training: ``[B, T, H]`` batches attend causally within each row (padding
                at the end of a row cannot reach earlier positions). At inference ``[T, H]`` rows of
                several sequences with their paged caches.
        Returns:
            ``[..., T, H]`` predicted hidden states (the input of the shared lm_head).
        """
        embeds = self.embed(input_ids).to(hidden_states.dtype)
        if self.normed:
            embeds, hidden_states = self.enorm(embeds), self.hnorm(hidden_states)
        x = self.eh_proj(torch.cat([embeds, hidden_states], dim=-1))
        residual = x
        if self.normed:
            x = self.input_layernorm(x)
        x = residual + self._attention(x, positions, kv)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x) if self.normed else x

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKV | None) -> torch.Tensor:
        cfg = self.config
        lead = x.shape[:-1]
        q = self.self_attn.q_proj(x).reshape(-1, cfg.num_attention_heads, cfg.head_dim)
        k = self.self_attn.k_proj(x).reshape(-1, cfg.num_key_value_heads, cfg.head_dim)
        v = self.self_attn.v_proj(x).reshape(-1, cfg.num_key_value_heads, cfg.head_dim)
        q, k = self.rotary(positions.reshape(-1), q, k)
        if kv is None:
            b, t = (1, lead[0]) if len(lead) == 1 else lead
            qb, kb, vb = (z.reshape(b, t, -1, cfg.head_dim).transpose(1, 2) for z in (q, k, v))
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                 enable_gqa=cfg.num_attention_heads != cfg.num_key_value_heads)
            out = out.transpose(1, 2).reshape(*lead, -1)
        else:
            out = self.paged_attention.forward(q, k, v, kv.key_cache, kv.value_cache, kv.md).reshape(*lead, -1)
        return self.self_attn.o_proj(out)

    def compute_logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., N]`` float32 logits over the draft vocabulary (N = V when full);
        map an index to a target token id with ``draft_to_target``."""
        if self.lm_head_weight is None:
            raise RuntimeError("attach_target() first: the head shares the target's lm_head")
        return F.linear(head_hidden, self.lm_head_weight.to(head_hidden.dtype)).float()

    # ------------------------------------------------------------------ checkpoints
    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under EAGLE checkpoint names (``fc``, ``layers.0.*``, ``norm``, ``d2t``/``t2d``)."""
        out = {}
        for name, t in self.state_dict().items():
            if name == "draft_to_target":
                continue
            out[_to_eagle_name(name)] = t.detach().contiguous()
        if self.config.draft_vocab_size is not None:
            ids = self.draft_to_target
            out["d2t"] = ids - torch.arange(ids.numel())  # EAGLE-3: target id = draft id + d2t
            t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            out["t2d"] = t2d
        return out

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (EAGLE names, float weights in ``dtype``)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in self.eagle_state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        cfg = self.config.to_hf_dict()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        return out


_EAGLE_TOP = {"eh_proj": "fc", "shared_head.norm": "norm", "enorm": "enorm", "hnorm": "hnorm"}


def _to_eagle_name(name: str) -> str:
    for ours, theirs in _EAGLE_TOP.items():
        if name.startswith(ours + "."):
            return theirs + name[len(ours):]
    return "layers.0." + name


_LAYER_PARTS = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj.",
                "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "input_layernorm.",
                "post_attention_layernorm.")
_TARGET_PARTS = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")


def map_checkpoint_names(names: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """Map checkpoint tensor names to :class:`DraftHead` parameter names.

    Understands the EAGLE layout (``fc``, ``layers.0.*``, ``norm``, ``enorm``, ``hnorm``,
    ``d2t``, ``t2d``) and DeepSeek-V3's MTP layout (``model.layers.{N}.eh_proj``, ``enorm``,
    ``hnorm``, ``shared_head.norm``, the decoder layer's ``self_attn``/``mlp``/norms).
    Returns ``(mapping, target_owned, unmapped)``: checkpoint name -> ours; names that belong to
    the target (embedding, lm_head: the head shares the target's, so they are skipped); names
    with no counterpart here (e.g. DeepSeek's MLA attention or MoE experts).
    """
    mapping, target_owned, unmapped = {}, [], []
    for name in names:
        base = re.sub(r"^model\.layers\.\d+\.", "", name)   # DeepSeek MTP: model.layers.{N}.*
        base = re.sub(r"^model\.", "", base)
        if base.startswith("layers.0."):
            base = base[len("layers.0."):]
        if base in ("d2t", "t2d"):
            mapping[name] = base
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
                    strict: bool = True) -> tuple[DraftHead, LoadReport]:
    """Load a head from a folder with ``config.json`` and ``*.safetensors``.

    Args:
        path: the checkpoint folder (our own, an EAGLE one, or DeepSeek-MTP tensors).
        config: overrides the folder's ``config.json`` (required when it has none).
        strict: raise when a head parameter is missing or a tensor cannot be mapped.
    Raises:
        FileNotFoundError: no safetensors file, or no config and none given.
        ValueError: a tensor's shape differs from the head's, or (strict) missing/unmapped names.
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
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    mapping, target_owned, unmapped = map_checkpoint_names(list(tensors))
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
