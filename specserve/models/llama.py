"""Llama-family decoder (Llama, Qwen2, SmolLM2) on flattened ragged batches.

Architecture (Touvron et al. 2023, "LLaMA", section 2.2; Qwen2 adds q/k/v biases): token
embedding, ``num_hidden_layers`` pre-norm blocks of RMSNorm -> grouped-query attention with rotary
position embeddings (Su et al. 2021, RoFormer, rotate-half form) -> residual, RMSNorm -> SwiGLU MLP
-> residual, then a final RMSNorm and the lm_head (tied to the embedding when the config says so).

The model takes ``input_ids [T]`` and ``positions [T]`` of several sequences concatenated, with an
:class:`~specserve.attention.metadata.AttentionMetadata` saying where each sequence's rows are, and
returns final hidden states ``[T, hidden_size]``; logits are computed only for the rows asked for.
Every op is row-wise (batch-invariant float or integer linears, per-row attention), so a token's
logits do not depend on what else is in the batch.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.metadata import AttentionMetadata
from specserve.attention.cpu_backend import AttentionPlan, CpuAttentionBackend
from specserve.config import ModelConfig
from specserve.models.linear import QuantizedLinear, make_linear
from specserve.models.parallel import ParallelLMHead, VocabParallelEmbedding, local_heads, row_parallel, unwrap
from specserve.models.quantization import check_quantization

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight`` over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def fused_layer_ops(config: ModelConfig, dtype: torch.dtype, device: torch.device):
    """The kernels module of the fused decoder layer (``rms_norm_rows``, ``silu_mul_rows``; the
    attention kernel's ``rope_write_kv``), or ``(None, why)`` where the model runs the PyTorch
    reference layer instead: ``SPECSERVE_FUSED=0``, not a float32 CPU model, shapes the kernels do not
    take (hidden_size or intermediate_size not a multiple of 8, head_dim not a multiple of 16), no
    AVX2 or no compiler.

    Returns:
        ``(ops, None)`` or ``(None, reason)``.
    """
    from specserve.kernels import KernelUnavailableError, attention_ops, quant_ops

    if os.environ.get("SPECSERVE_FUSED", "1") == "0":
        return None, "SPECSERVE_FUSED=0"
    if device.type != "cpu" or dtype != torch.float32:
        return None, f"a {dtype} model on {device.type} (the fused layer serves float32 on the CPU)"
    if config.hidden_size % 8 or config.intermediate_size % 8 or config.head_dim % 16:
        return None, (f"hidden_size {config.hidden_size}, intermediate_size {config.intermediate_size}, head_dim "
                      f"{config.head_dim} (the fused layer needs multiples of 8, 8 and 16)")
    try:
        attention_ops()
        return quant_ops(), None
    except KernelUnavailableError as e:
        return None, str(e)


def _apply(linear: nn.Module, rows: list[torch.Tensor]) -> torch.Tensor:
    """``linear`` on a fused op's output: float rows ``[x]`` or quantized ``[xq, dx, bsum]``."""
    return linear.forward_quantized(*rows) if len(rows) == 3 else linear(rows[0])


class RotaryEmbedding(nn.Module):
    """Rotary embedding, rotate-half layout (the Hugging Face Llama/Qwen2 convention).

    ``forward(positions [T], q [T, H, D], k [T, Hkv, D])`` -> rotated ``(q, k)``.
    """

    def __init__(self, head_dim: int, rope_theta: float, max_position: int):
        super().__init__()
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, D]`` of ``positions`` (computed once per forward, used by every layer)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, tables=None):
        cos, sin = tables if tables is not None else self.tables(positions, q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class DecoderLayer(nn.Module):
    """One pre-norm block: GQA attention with RoPE, then a SwiGLU MLP.

    q/k/v projections are fused into one linear (``qkv_proj``) and gate/up into ``gate_up_proj``.
    """

    def __init__(self, cfg: ModelConfig, w: dict, prefix: str, rotary: RotaryEmbedding,
                 quantization: str = "none", tp=None):
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        # under tensor parallelism this rank's heads (``w`` holds its shard); o_proj and down_proj
        # are row-parallel: their partial sums are added up by the group (specserve.models.parallel)
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        a = prefix + "self_attn."
        qkv_b = None
        if cfg.attention_bias:
            qkv_b = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        linear = lambda names, bias=None: make_linear([w[n] for n in names], bias, quantization, names[0])
        self.qkv_proj = linear([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], qkv_b)
        self.o_proj = row_parallel(linear([a + "o_proj.weight"]), tp)
        m = prefix + "mlp."
        self.gate_up_proj = linear([m + "gate_proj.weight", m + "up_proj.weight"])
        self.down_proj = row_parallel(linear([m + "down_proj.weight"]), tp)
        self.input_layernorm = nn.Parameter(w[prefix + "input_layernorm.weight"], requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(w[prefix + "post_attention_layernorm.weight"],
                                                     requires_grad=False)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.attn = CpuAttentionBackend(self.num_heads, self.num_kv_heads, cfg.head_dim)
        # which of the fused ops' outputs feed an integer linear (then they quantize the rows)
        self._quantized = tuple(isinstance(unwrap(m), QuantizedLinear)
                                for m in (self.qkv_proj, self.gate_up_proj, self.down_proj))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, md: AttentionMetadata, rope_tables=None) -> torch.Tensor:
        cfg = self.cfg
        T = hidden.shape[0]
        x = rms_norm(hidden, self.input_layernorm, cfg.rms_norm_eps)
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, cfg.head_dim)
        k = k.reshape(T, self.num_kv_heads, cfg.head_dim)
        v = v.reshape(T, self.num_kv_heads, cfg.head_dim)
        q, k = self.rotary(positions, q, k, rope_tables)
        attn = self.attn.forward(q, k, v, key_cache, value_cache, md)  # [T, H, D]
        hidden = hidden + self.o_proj(attn.reshape(T, self.q_size))
        x = rms_norm(hidden, self.post_attention_layernorm, cfg.rms_norm_eps)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return hidden + self.down_proj(F.silu(gate) * up)

    def forward_fused(self, ops, positions: torch.Tensor, hidden: torch.Tensor, delta: torch.Tensor | None,
                      key_cache: torch.Tensor, value_cache: torch.Tensor,
                      plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` in six native calls besides the linears, the residual stream kept as
        ``hidden + delta`` (the add happens inside the next RMSNorm call).

        Args:
            ops: :func:`fused_layer_ops`'s module.
            hidden, delta: ``[T, hidden_size]`` float32, the stream entering the layer is
                ``hidden + delta`` (``delta`` None: ``hidden``).
            plan: the batch's attention plan.
        Returns:
            ``(hidden, delta)``: the stream leaving the layer is their sum.
        """
        # the parts as plain attributes: nn.Module's __getattr__ costs ~1 us an access, 16 a layer
        parts = self.__dict__.get("_fused_parts")
        if parts is None:
            parts = self.__dict__["_fused_parts"] = (
                self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj, self.input_layernorm.data,
                self.post_attention_layernorm.data, self.rotary.cos, self.rotary.sin)
        qkv_proj, o_proj, gate_up_proj, down_proj, ln1, ln2, cos, sin = parts
        q1, q2, q3 = self._quantized
        eps, T = self.cfg.rms_norm_eps, hidden.shape[0]
        hidden, *x = ops.rms_norm_rows(hidden, delta, ln1, eps, q1)
        qkv = _apply(qkv_proj, x)
        attn = self.attn.run_fused(qkv, positions, cos, sin, key_cache, value_cache, plan)
        o = _apply(o_proj, [attn.view(T, self.q_size)])
        hidden, *x = ops.rms_norm_rows(hidden, o, ln2, eps, q2)
        x = ops.silu_mul_rows(_apply(gate_up_proj, x), q3)
        return hidden, _apply(down_proj, x)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / SmolLM2 decoder built from Hugging Face-named weights.

    Args:
        config: the model's shape.
        weights: Hugging Face parameter names -> tensors (see ``specserve.models.loader``); linear
            weights may be :class:`~specserve.models.quantization.QuantizedTensor` (read straight
            from GGUF blocks); ``lm_head.weight`` may be absent when embeddings are tied.
        quantization: ``"none"`` (float linears), ``"int8"`` or ``"int4"`` (our batch-invariant
            integer kernels, :mod:`specserve.models.quantization`). Every linear is batch-invariant
            either way, so speculation stays exact relative to the same model run without it.
        tp: a :class:`~specserve.distributed.group.TensorParallelGroup` with its ``shard``
            (:class:`~specserve.distributed.sharding.TensorParallelShard`): ``weights`` are then this
            rank's shard (:func:`~specserve.distributed.sharding.shard_weights`), the embedding and the
            row-parallel outputs are all-reduced and the logits gathered, so every rank computes the
            same full hidden states and logits.
        lm_head_rows: ``[N]`` int64 vocabulary ids: the lm_head keeps only these rows and
            :meth:`compute_logits` returns ``[., N]`` logits of them, in this order (a draft's
            reduced vocabulary, :mod:`specserve.spec_decode.draft_vocab`; not with ``tp``).
    Raises:
        ValueError: an unknown quantization, a weight shape it cannot pack, or no kernel here.
    """

    def __init__(self, config: ModelConfig, weights: dict, quantization: str = "none", tp=None,
                 lm_head_rows: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        max_pos = max(config.max_position_embeddings, 1)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, max_pos)
        self.embed = VocabParallelEmbedding(weights["model.embed_tokens.weight"], tp)
        self.quantization = quantization = check_quantization(quantization)
        t0 = time.perf_counter()
        layers = range(config.num_hidden_layers)
        if quantization != "none":   # each quantized linear is repacked for the kernels (weight_packing)
            from tqdm import tqdm

            layers = tqdm(layers, desc=f"packing {quantization} layers", unit="layer", leave=False,
                          disable=not sys.stderr.isatty())
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}.", self.rotary, quantization, tp) for i in layers)
        self.norm = nn.Parameter(weights["model.norm.weight"], requires_grad=False)
        # A tied model's head may come quantized from the embedding's own blocks (the loader's).
        head = weights.get("lm_head.weight")
        if head is None:
            head = weights["model.embed_tokens.weight"]
        self.lm_head_rows = lm_head_rows
        ParallelLMHead.check_rows(lm_head_rows, tp)
        if lm_head_rows is not None:
            head = head.select_rows(lm_head_rows) if hasattr(head, "select_rows") else head.index_select(0, lm_head_rows)
        self.lm_head = ParallelLMHead(make_linear([head], None, quantization, "lm_head.weight"), config.vocab_size, tp)
        if quantization != "none":
            packed = [m for m in self.modules() if isinstance(m, QuantizedLinear)]
            logger.info("packed %d %s linears for the kernels in %.1f s: %.1f MB (16-row groups, padding included)",
                        len(packed), quantization, time.perf_counter() - t0, sum(m.nbytes for m in packed) / 1e6)
        # EAGLE-3 heads read low / middle / high layers too (set by the engine from the proposer)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        # the fused layer where the kernels take this model; the PyTorch layer stays the reference
        # (set ``fused = False`` to run it)
        self._fused_ops, why = fused_layer_ops(config, self.embed_tokens.dtype, self.embed_tokens.device)
        self.fused = self._fused_ops is not None
        if why is not None and os.environ.get("SPECSERVE_FUSED", "1") != "0":
            logger.warning("the decoder layers run on the PyTorch reference path: %s", why)

    @property
    def embed_tokens(self) -> torch.Tensor:
        """``[V, hidden_size]`` (this rank's rows under tensor parallelism)."""
        return self.embed.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                kv_caches: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Run the decoder over a flattened batch.

        Args:
            input_ids: ``[T]`` int64 token ids of all sequences, concatenated.
            positions: ``[T]`` int64 position of each token in its sequence.
            md: attention metadata of the batch.
            kv_caches: ``(key_cache, value_cache)``, each
                ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
        Returns:
            ``[T, hidden_size]`` final hidden states (after the last RMSNorm); with
            ``aux_hidden_state_layers`` = (l_1 .. l_n), ``[T, (1 + n) * hidden_size]``: the final
            hidden states, then the residual stream entering each layer l_i (EAGLE-3's low / middle /
            high features; Li et al. 2025, section 3.2). :meth:`compute_logits` reads the first part.
        """
        key_cache, value_cache = kv_caches
        hidden = self.embed(input_ids)
        aux = []
        if self._runs_fused(hidden, key_cache):
            ops, plan, delta = self._fused_ops, AttentionPlan.build(md), None
            positions = positions.to(torch.int64).contiguous()
            for i, layer in enumerate(self.layers):
                if i in self.aux_hidden_state_layers:
                    hidden, delta = (hidden if delta is None else hidden + delta), None
                    aux.append(hidden)
                hidden, delta = layer.forward_fused(ops, positions, hidden, delta, key_cache[i], value_cache[i], plan)
            final = ops.rms_norm_rows(hidden, delta, self.norm, self.config.rms_norm_eps, False)[1]
        else:
            tables = self.rotary.tables(positions, hidden.dtype)
            for i, layer in enumerate(self.layers):
                if i in self.aux_hidden_state_layers:
                    aux.append(hidden)
                hidden = layer(positions, hidden, key_cache[i], value_cache[i], md, tables)
            final = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return torch.cat([final, *aux], dim=-1) if aux else final

    def _runs_fused(self, hidden: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (self.fused and hidden.shape[0] > 0 and hidden.dtype == torch.float32
                and self.layers[0].attn.fused_available(key_cache))

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` (or the wider output of :meth:`forward` with auxiliary layers) ->
        ``[N, vocab_size]`` float32 logits of the rows given."""
        return self.lm_head(hidden_states[:, :self.config.hidden_size].contiguous())
