"""Quantized weights repacked for the kernels: 16 weight rows interleaved, one row per vector lane.

A :class:`~specserve.models.quantization.QuantizedTensor` stores a weight row by row. The kernels
(``specserve/kernels/quant_linear.cpp``) want the opposite for many activation rows: one vector of
16 weight rows' next four values, so that one four-way integer dot product against an activation
quad broadcast to every lane advances 16 outputs, and a register tile of activation rows x such
vectors reuses each weight vector for every row. llama.cpp's repacked ``block_q4_Kx8`` and
ik_llama.cpp's ``_R8`` types interleave rows the same way.

The repack happens once, when a linear is built (:class:`~specserve.models.linear.QuantizedLinear`),
and replaces the row-major integers (the same bytes, in another order): no second copy is kept.
:meth:`PackedWeight.unpack` gives the row-major tensor back, exactly (for ``dequantize`` and tests).

Layouts (N weight rows padded with zero rows to G = ceil(N / 16) groups, K = in_features, S =
ceil(K / 256) superblocks):

- ``int4``: ``wq`` uint8 ``[G, K / 32, 4, 16, 4]``: for 32-value sub-block j and quad pair c, byte
  ``4w + i`` holds weight row ``16g + w``'s value ``32j + 8c + i`` in its low nibble and value
  ``32j + 8c + 4 + i`` in its high one; ``sc`` uint8 ``[G, K / 32, 16]``; ``mn`` int16
  ``[G, K / 64, 16, 2]`` (the mins of sub-blocks 2p and 2p + 1 side by side, for one ``vpdpwssd``
  against the activations' sub-block sums); ``d``, ``dmin`` float32 ``[G, S, 16]``.
- ``int8``: ``wq`` int8 ``[G, K / 16, 4, 16, 4]`` (16-value sub-block j, quad t: bytes ``4w + i``
  = value ``16j + 4t + i``); ``sc`` int8 ``[G, K / 16, 16]``; ``d`` float32 ``[G, S, 16]``;
  ``corr`` int32 ``[G, S, 16]`` = ``-128 * sum_j sc[j] * (sum of sub-block j's integers)`` per
  superblock (the VNNI kernel feeds the activations offset by 128 as unsigned bytes and takes the
  offset's share off again).
- ``int6`` (Q6_K's integers, u = q + 32 in 0..63): ``wq`` uint8 ``[G, K / 16, 192]``: per 16-value
  sub-block j, 128 bytes of nibbles (64-byte block c, byte ``4w + i``: the low four bits of value
  ``16j + 8c + i`` in the low nibble, of value ``16j + 8c + 4 + i`` in the high one), then 64 bytes
  of top bits (byte ``4w + i``, bits ``2t..2t+1``: value ``16j + 4t + i``'s top two): 0.75 bytes a
  weight, the file's own; ``sc`` as int8; ``sc2`` int16 ``[G, K / 32, 16, 2]`` (the scales of
  sub-blocks 2p and 2p + 1 side by side, for the ``-32 * sum_j sc[j] * sum(x)`` correction);
  ``d`` as int8.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.quantization import SUPERBLOCK, QuantizedTensor, kernel_order, natural_order, pack_int4, unpack_int4

GROUP_ROWS = 16


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[N, ...]`` -> ``[G, 16, ...]``, rows past N zero."""
    padded = t.new_zeros((groups * GROUP_ROWS,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    return padded.view(groups, GROUP_ROWS, *t.shape[1:])


def _lanes_last(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-row values ``[N, C]`` -> ``[G, C, 16]`` (a group's 16 rows side by side)."""
    return _grouped(t, groups).permute(0, 2, 1).contiguous()


def _rows_first(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_lanes_last`: ``[G, C, 16]`` -> ``[N, C]``."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n].contiguous()


@dataclass
class PackedWeight:
    """A ``[n, k]`` int4 / int8 weight in the kernels' interleaved layout (module docstring).

    Attributes:
        layout: ``"int4"`` or ``"int8"``; n, k: out_features, in_features.
        wq, sc, d: the integers, sub-block scales and superblock scales; mn, dmin (int4) the mins;
            corr (int8) the offset correction; sc2 (int6) the scales in pairs.
        source: where the values came from (``"Q4_K"``, ``"float"``, ...), for reports.
    """

    layout: str
    n: int
    k: int
    wq: torch.Tensor
    sc: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    corr: torch.Tensor | None = None
    sc2: torch.Tensor | None = None
    source: str = "float"

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        """Bytes one forward reads (padding rows included)."""
        return sum(t.numel() * t.element_size() for t in (self.wq, self.sc, self.d, self.mn, self.dmin, self.corr,
                                                          self.sc2) if t is not None)

    @staticmethod
    def pack(qt: QuantizedTensor) -> "PackedWeight":
        """``qt`` in the interleaved layout (the same integers and scales; exact)."""
        n, k = qt.shape
        g = -(-n // GROUP_ROWS)
        if qt.layout == "int4":
            q = _grouped(unpack_int4(qt.qs), g).view(g, GROUP_ROWS, k // 32, 4, 2, 4)   # [G, w, j, c, h, i]
            q = q.permute(0, 2, 3, 1, 5, 4)                                              # [G, j, c, w, i, h]
            wq = (q[..., 0] | (q[..., 1] << 4)).contiguous()
            mn = _grouped(qt.mn.to(torch.int16), g).view(g, GROUP_ROWS, k // 64, 2).permute(0, 2, 1, 3).contiguous()
            return PackedWeight("int4", n, k, wq, _lanes_last(qt.sc, g), _lanes_last(qt.d, g), mn=mn,
                                dmin=_lanes_last(qt.dmin, g), source=qt.source)
        q = qt.qs[:, natural_order(k)]                                                   # [N, K] column order
        if qt.layout == "int6":
            if q.min() < -32 or q.max() > 31:
                raise ValueError("an int6 weight holds integers outside -32..31")
            u = _grouped((q + 32).to(torch.uint8), g).view(g, GROUP_ROWS, k // 16, 4, 4)
            u = u.permute(0, 2, 3, 1, 4)                                                 # [G, j, t, w, i]
            nib = (u[:, :, 0::2] & 0x0F) | ((u[:, :, 1::2] & 0x0F) << 4)                # [G, j, c, w, i]
            top = sum((u[:, :, t] >> 4) << (2 * t) for t in range(4)).to(torch.uint8)   # [G, j, w, i]
            wq = torch.cat([nib.reshape(g, k // 16, 128), top.reshape(g, k // 16, 64)], dim=2).contiguous()
            sc2 = _grouped(qt.sc.to(torch.int16), g).view(g, GROUP_ROWS, k // 32, 2).permute(0, 2, 1, 3).contiguous()
            return PackedWeight("int6", n, k, wq, _lanes_last(qt.sc, g), _lanes_last(qt.d, g), sc2=sc2,
                                source=qt.source)
        wq = _grouped(q, g).view(g, GROUP_ROWS, k // 16, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
        # the offset correction per superblock, exact in int64 and well inside int32 (< 2^30)
        sums = q.view(n, k // 16, 16).sum(-1, dtype=torch.int64) * qt.sc.to(torch.int64)   # [N, K/16]
        s = qt.d.shape[1]
        per = SUPERBLOCK // 16
        padded = sums.new_zeros(n, s * per)
        padded[:, : k // 16] = sums
        corr = (-128 * padded.view(n, s, per).sum(-1)).to(torch.int32)
        return PackedWeight("int8", n, k, wq, _lanes_last(qt.sc, g), _lanes_last(qt.d, g),
                            corr=_lanes_last(corr, g), source=qt.source)

    def unpack(self) -> QuantizedTensor:
        """The row-major :class:`QuantizedTensor` this was packed from (exact)."""
        n, k = self.n, self.k
        if self.layout == "int4":
            g = self.wq.shape[0]
            q = torch.stack([self.wq & 0x0F, self.wq >> 4], dim=-1)                      # [G, j, c, w, i, h]
            q = q.permute(0, 3, 1, 2, 5, 4).reshape(g * GROUP_ROWS, k)[:n]
            mn = self.mn.permute(0, 2, 1, 3).reshape(g * GROUP_ROWS, k // 32)[:n].to(torch.uint8).contiguous()
            return QuantizedTensor("int4", pack_int4(q), _rows_first(self.sc, n), mn, _rows_first(self.d, n),
                                   _rows_first(self.dmin, n), self.source)
        if self.layout == "int6":
            g = self.wq.shape[0]
            nib = self.wq[:, :, :128].reshape(g, k // 16, 2, GROUP_ROWS, 4)
            top = self.wq[:, :, 128:].reshape(g, k // 16, GROUP_ROWS, 4)
            low = torch.stack([nib & 0x0F, nib >> 4], dim=3).reshape(g, k // 16, 4, GROUP_ROWS, 4)
            high = torch.stack([(top >> (2 * t)) & 3 for t in range(4)], dim=2)           # [G, j, t, w, i]
            u = (low | (high << 4)).to(torch.int16) - 32
            q = u.to(torch.int8).permute(0, 3, 1, 2, 4).reshape(-1, k)[:n]
        else:
            q = self.wq.permute(0, 3, 1, 2, 4).reshape(-1, k)[:n]
        return QuantizedTensor(self.layout, q[:, kernel_order(k)].contiguous(), _rows_first(self.sc, n), None,
                               _rows_first(self.d, n), None, self.source)
