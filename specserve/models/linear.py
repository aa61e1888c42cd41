"""Batch-invariant linear layers.

Speculative verification runs the target over k+1 tokens at once and must reproduce single-token
decoding bit for bit, so a row's output may not depend on how many rows are multiplied with it.
On CPU the default ``F.linear`` (MKL) picks different kernels for 1 and for several rows (results
differ by ~1e-4) and costs several times more for 5 rows than for 1. oneDNN's prepacked linear
(``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``) keeps each row's result
identical for any row count and its cost for a few rows close to one row's. Elsewhere (CUDA,
other dtypes) we fall back to ``F.linear``.

:class:`QuantizedLinear` is the same contract over int8 / int4 weights, on our own integer kernels
(``--quantization``; docs/quantization.md). :func:`make_linear` builds either from weight blocks.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from specserve.models.quantization import QuantizedTensor


def onednn_available(weight: torch.Tensor) -> bool:
    """True when the prepacked oneDNN path serves ``weight`` (CPU float32 with mkldnn built in)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class BatchInvariantLinear(nn.Module):
    """``y = x @ W.T + b`` whose row results do not depend on the number of rows.

    Args:
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.
    Forward: ``x [T, in_features]`` -> ``[T, out_features]``, same dtype as the weight.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.prepacked = onednn_available(weight)
        if self.prepacked:
            # No batch-size hint: the blocked layout chosen then is shared by every row count.
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight (and bias) one forward reads."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        if self.prepacked:
            if x.shape[0] == 1:
                # oneDNN runs one row (in_features >= 1536 measured) on another kernel than two or more
                # rows, which rounds differently: a decode step would then not match a verify's rows.
                # Two copies of the row take the many-row kernel, at the cost of one row's arithmetic.
                return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.weight, self.bias,
                                                          "none", [], "")[:1]
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, prepacked={self.prepacked}")


class QuantizedLinear(nn.Module):
    """Batch-invariant ``y = x @ W.T + b`` over int8 / int4 weights (our AVX2 kernels).

    The weight may be several row blocks of different layouts (a fused q/k/v whose v is int8 while
    q and k are int4, as GGUF Q4_K_M files store them); each block writes its own output columns.
    Activations are quantized once per call, per row (see :mod:`specserve.models.quantization`), so
    a row's output bits never depend on the other rows.

    Args:
        parts: ``QuantizedTensor`` blocks stacked along ``out_features``, all of one ``in_features``.
        bias: ``[out_features]`` float32 or None.
    Forward: ``x [T, in_features]`` float32 -> ``[T, out_features]`` float32.
    Raises:
        KernelUnavailableError (a ValueError): no AVX2 CPU or no compiler for the kernels.
    """

    def __init__(self, parts: "list[QuantizedTensor]", bias: torch.Tensor | None = None):
        super().__init__()
        from specserve.kernels import quant_ops
        from specserve.models.weight_packing import PackedWeight

        self._ops = quant_ops()
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        # the kernels' interleaved layout replaces the row-major integers (no second copy)
        self.packed = [PackedWeight.pack(p) for p in parts]
        self.offsets = list(itertools.accumulate([0] + [p.shape[0] for p in parts]))[:-1]
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self._part_bias = [None if bias is None else self.bias.data[o:o + p.shape[0]]
                           for o, p in zip(self.offsets, parts)]

    @property
    def parts(self) -> "list[QuantizedTensor]":
        """The weight blocks as row-major ``QuantizedTensor`` s (unpacked on each call: exact, not fast)."""
        return [p.unpack() for p in self.packed]

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight blocks one forward reads."""
        return sum(p.nbytes for p in self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.empty(0, self.out_features, dtype=torch.float32)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        return self.forward_quantized(*self._ops.quantize_rows(x))

    def forward_quantized(self, xq: torch.Tensor, dx: torch.Tensor, bsum: torch.Tensor) -> torch.Tensor:
        """The linear on activations already quantized (``quantize_rows``'s form, or a fused op's
        that ends in the same quantization: ``rms_norm_rows``, ``silu_mul_rows``).

        Args:
            xq: ``[T, in_features]`` int8 in the kernels' order; dx: ``[T, S]`` float32 scales
                (``S = ceil(in_features / 256)``); bsum: ``[T, in_features / 32]`` int32 block sums.
        Returns:
            ``[T, out_features]`` float32.
        """
        out = torch.empty(xq.shape[0], self.out_features, dtype=torch.float32)
        if xq.shape[0] == 0:
            return out
        for p, col0, bias in zip(self.packed, self.offsets, self._part_bias):
            if p.layout == "int4":
                self._ops.q4_matmul(xq, dx, bsum, p.wq, p.sc, p.mn, p.d, p.dmin, p.n, bias, out, col0)
            elif p.layout == "int6":
                self._ops.q6_matmul(xq, dx, p.wq, p.sc, p.sc2, p.d, p.n, bias, out, col0)
            else:
                self._ops.q8_matmul(xq, dx, p.wq, p.sc, p.corr, p.d, p.n, bias, out, col0)
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight."""
        return torch.cat([p.dequantize() for p in self.parts])

    def extra_repr(self) -> str:
        layouts = "+".join(f"{p.layout}({p.source})" for p in self.packed)
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {layouts}"


def make_linear(parts: "list[torch.Tensor | QuantizedTensor]", bias: torch.Tensor | None = None,
                quantization: str = "none", name: str = "weight") -> nn.Module:
    """A batch-invariant linear over weight row blocks ``parts`` (fused projections).

    ``quantization``: ``"none"`` keeps float weights (:class:`BatchInvariantLinear`; quantized
    parts are dequantized); ``"int8"`` / ``"int4"`` quantize float parts into that layout and keep
    already quantized parts (from GGUF blocks) as they are (:class:`QuantizedLinear`).

    Raises:
        ValueError: a shape the layout cannot pack (naming ``name``), or no kernel on this machine.
    """
    from specserve.models.quantization import QuantizedTensor, quantize

    if quantization == "none":
        ws = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
        return BatchInvariantLinear(ws[0] if len(ws) == 1 else torch.cat(ws), bias)
    qparts = [p if isinstance(p, QuantizedTensor) else quantize(p, quantization, name) for p in parts]
    merged: list[QuantizedTensor] = []
    for p in qparts:  # neighbours of one layout become one block (one kernel call)
        if merged and merged[-1].layout == p.layout:
            merged[-1] = QuantizedTensor.cat([merged[-1], p])
        else:
            merged.append(p)
    return QuantizedLinear(merged, bias)
