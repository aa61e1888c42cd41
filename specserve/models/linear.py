"""Batch-invariant linear layers.

Speculative verification runs the target over k+1 tokens at once and must reproduce single-token
decoding bit for bit, so a row's output may not depend on how many rows are multiplied with it.
On CPU the default ``F.linear`` (MKL) picks different kernels for 1 and for several rows (results
differ by ~1e-4) and costs several times more for 5 rows than for 1. oneDNN's prepacked linear
(``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``) keeps each row's result
identical for any row count and its cost for a few rows close to one row's
(../shared/DESIGN.md, "Measuring"). Elsewhere (CUDA, other dtypes) we fall back to ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, prepacked={self.prepacked}")


class Int8DynamicLinear(nn.Module):
    """Dynamically quantized int8 linear (fbgemm): weights int8 per output channel, activations
    quantized per call with one scale per tensor.

    Lossy (a few percent relative error) and not batch-invariant, so it is for drafts only: a draft's
    numerics change which tokens are proposed, never which are emitted, because verification samples
    from the target's distribution. About 6x cheaper than float32 on a CPU without AVX-512
    (../shared/DESIGN.md, "Measuring").

    Args:
        weight: ``[out_features, in_features]`` float.
        bias: ``[out_features]`` or None.
    Forward: ``x [T, in_features]`` float32 -> ``[T, out_features]`` float32.
    Raises:
        RuntimeError: when this PyTorch build has no quantized CPU engine.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        weight = weight.detach().float()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        qweight = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.int64),
                                             axis=0, dtype=torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.quantized.linear_dynamic(x.contiguous(), self._packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic"


LINEAR_KINDS = {"float": BatchInvariantLinear, "int8": Int8DynamicLinear}
