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

The head's shape is a :class:`~specserve.models.draft_head_config.DraftHeadConfig`; checkpoints
(EAGLE-3, EAGLE and DeepSeek-MTP layouts) are written and read by
:mod:`specserve.models.draft_head_checkpoint`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.metadata import AttentionMetadata
from specserve.attention.cpu_backend import CpuAttentionBackend
from specserve.models.draft_head_config import DraftHeadConfig
from specserve.models.llama import RotaryEmbedding, rms_norm


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
        from specserve.models.draft_head_checkpoint import eagle_state_dict

        return eagle_state_dict(self)

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (EAGLE names, float weights in ``dtype``)."""
        from specserve.models.draft_head_checkpoint import save_draft_head

        return save_draft_head(self, out_dir, dtype)


def target_layer_tensors(weights: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``index``'s tensors of a target's weights (``model.layers.{index}.*``), by name
    without that prefix: what :meth:`DraftHead.init_from_target_layer` reads."""
    prefix = f"model.layers.{index}."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
