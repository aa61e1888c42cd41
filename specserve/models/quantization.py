"""Quantized weights for batch-invariant int8 / int4 linears (``--quantization``, vLLM's flag).

Two weight layouts, both "k-quants" (llama.cpp's superblock formats, ggml ``k_quants``): along
``in_features`` the row is cut into superblocks of 256 (the last may be shorter), each with a float
scale, and each superblock into sub-blocks with small integer scales:

- ``int4``: ``w = d[s] * sc[j] * q - dmin[s] * mn[j]``, ``q`` in 0..15 packed two per byte,
  sub-blocks of 32 with 8-bit ``sc`` / ``mn``. A GGUF ``Q4_K`` tensor maps onto it exactly.
- ``int8``: ``w = d[s] * sc[j] * q``, ``q`` in -127..127, sub-blocks of 16 with int8 ``sc``. A GGUF
  ``Q6_K`` tensor maps onto it exactly.
- ``int6``: ``int8`` whose integers lie in -32..31: a GGUF ``Q6_K`` tensor, stored as int8 here and
  packed to 6 bits for the kernels (:mod:`specserve.models.weight_packing`), so a forward reads the
  file's bytes, not a widened copy. Same values and same results as the int8 layout holding them.

Both store their integers in the kernels' order (:func:`kernel_order`: within a superblock, groups
of four values transposed, so each 32-value block fills one int32 lane of a vector); scales, mins
and :meth:`QuantizedTensor.dequantize` are in the natural column order.

Activations are quantized per row and per superblock to int8 (``d_x = amax / 127``), so a row's
result never depends on the other rows; the kernels (``specserve/kernels/quant_linear.cpp``) sum
the integer products exactly and add one float term per superblock in a fixed order, which makes
every row bitwise independent of the row count. :func:`reference_matmul` is the same arithmetic in
float64 (the tests' oracle).

GGUF tensors of other types, and float tensors (Hugging Face folders), are quantized from their
float values by :func:`quantize` (absmax sub-block scales; asymmetric min/scale for int4).
Which layout a GGUF tensor takes under ``int4`` follows llama.cpp's own mixes: tensors the file
keeps at more than ~4.5 bits (Q5_*, Q6_K, Q8_0) go to int8, so the error never grows past the
file's, and the rest (Q4_*, Q3_K, Q2_K, float) to int4 (:func:`layout_for`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from specserve.config import QUANTIZATIONS, check_quantization  # noqa: F401  (validated with the configs)

SUPERBLOCK = 256
_ROWS_PER_CHUNK = 8192
_HIGH_PRECISION_GGUF = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "F32", "F64"}
_FLOAT_GGUF = {"F16", "BF16", "F32", "F64"}


@dataclass
class QuantizedTensor:
    """A ``[out_features, in_features]`` weight in the ``int4`` or ``int8`` layout.

    Attributes (N = out_features, K = in_features, S = ceil(K / 256)):
        layout: ``"int4"``, ``"int8"`` or ``"int6"`` (int8 with values in -32..31).
        qs: int4: uint8 ``[N, K / 2]``, two values per byte (:func:`pack_int4`); int8 / int6: int8
            ``[N, K]``; both in the kernels' column order (:func:`kernel_order`).
        sc: int4: uint8 ``[N, K / 32]``; int8 / int6: int8 ``[N, K / 16]``.
        mn: int4: uint8 ``[N, K / 32]`` sub-block mins; int8: None.
        d, dmin: float32 ``[N, S]`` superblock scales (``dmin`` int4 only).
        source: where the values came from (``"Q4_K"``, ``"float"``, ...), for reports.
    """

    layout: str
    qs: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None
    source: str = "float"

    @property
    def shape(self) -> tuple[int, int]:
        n, packed = self.qs.shape
        return n, packed * (2 if self.layout == "int4" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.sc, self.mn, self.d, self.dmin)
                   if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight these integers represent (float32: bitwise what gguf's own
        dequantizer gives for Q4_K / Q6_K blocks; float64: the kernels' exact reference)."""
        n, k = self.shape
        sup = _expand_superblocks(self.d, k, dtype)  # [N, K]
        if self.layout != "int4":
            q = self.qs[:, natural_order(k)]
            return sup * self.sc.to(dtype).repeat_interleave(16, dim=1) * q.to(dtype)
        q = unpack_int4(self.qs).to(dtype)
        sc = self.sc.to(dtype).repeat_interleave(32, dim=1)
        mn = self.mn.to(dtype).repeat_interleave(32, dim=1)
        return sup * sc * q - _expand_superblocks(self.dmin, k, dtype) * mn

    def select_rows(self, index: torch.Tensor) -> "QuantizedTensor":
        """The weight with its output rows reordered (``index [N]`` int64)."""
        pick = lambda t: None if t is None else t[index].contiguous()
        return QuantizedTensor(self.layout, pick(self.qs), pick(self.sc), pick(self.mn), pick(self.d),
                               pick(self.dmin), self.source)

    def select_columns(self, start: int, end: int) -> "QuantizedTensor":
        """The weight's ``in_features`` slice ``start:end`` (a tensor-parallel row shard).

        Both ends must fall on superblock boundaries (multiples of 256, or ``end`` = K), so every
        superblock and its scales stay whole and a row's activation superblocks line up with the
        unsharded weight's. Raises ValueError otherwise."""
        k = self.shape[1]
        if not (0 <= start < end <= k) or start % SUPERBLOCK or (end % SUPERBLOCK and end != k):
            raise ValueError(f"columns {start}:{end} of a {self.layout} weight with in_features {k} do not "
                             f"fall on {SUPERBLOCK}-value superblock boundaries")
        s0, s1 = start // SUPERBLOCK, -(-end // SUPERBLOCK)
        cut = lambda t, per: None if t is None else t[:, start // per:-(-end // per)].contiguous()
        if self.layout == "int4":
            return QuantizedTensor("int4", cut(self.qs, 2), cut(self.sc, 32), cut(self.mn, 32),
                                   self.d[:, s0:s1].contiguous(), self.dmin[:, s0:s1].contiguous(), self.source)
        return QuantizedTensor(self.layout, cut(self.qs, 1), cut(self.sc, 16), None, self.d[:, s0:s1].contiguous(),
                               None, self.source)

    @staticmethod
    def cat(parts: "list[QuantizedTensor]") -> "QuantizedTensor":
        """Concatenate weights of one layout along ``out_features`` (fused q/k/v, gate/up)."""
        layout = parts[0].layout
        assert all(p.layout == layout for p in parts)
        if len(parts) == 1:
            return parts[0]
        cat = lambda name: (None if getattr(parts[0], name) is None
                            else torch.cat([getattr(p, name) for p in parts]))
        sources = sorted({s for p in parts for s in p.source.split("+")})
        return QuantizedTensor(layout, cat("qs"), cat("sc"), cat("mn"), cat("d"), cat("dmin"), "+".join(sources))


def _expand_superblocks(v: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, S]`` per-superblock values -> ``[N, K]``."""
    return v.to(dtype).repeat_interleave(SUPERBLOCK, dim=1)[:, :k]


@functools.lru_cache(maxsize=64)
def kernel_order(k: int) -> torch.Tensor:
    """``[K]`` int64: the natural column whose value the kernels' layout stores at each position.

    Within a superblock of ``L = 32 * B`` values (B = 8 but in a short last one), position
    ``t * 4B + 4b + i`` holds column ``32b + 4t + i`` (t < 8, b < B, i < 4): groups of four
    transposed, so byte group b of every 32-byte vector holds 32-value block b and a four-way
    integer dot product leaves block b's sum alone in int32 lane b (``quant_linear.cpp``).
    ``k`` must be a multiple of 32.
    """
    parts = []
    for k0 in range(0, k, SUPERBLOCK):
        nsub = min(SUPERBLOCK, k - k0) // 32
        t, b, i = torch.arange(8).view(8, 1, 1), torch.arange(nsub).view(1, nsub, 1), torch.arange(4).view(1, 1, 4)
        parts.append((k0 + 32 * b + 4 * t + i).reshape(-1))
    return torch.cat(parts)


@functools.lru_cache(maxsize=64)
def natural_order(k: int) -> torch.Tensor:
    """``[K]`` int64: the inverse of :func:`kernel_order` (``stored[:, natural_order(k)]`` is in
    column order)."""
    return torch.argsort(kernel_order(k))


@functools.lru_cache(maxsize=64)
def _nibble_columns(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The natural columns of each packed int4 byte's low and high nibble, ``([K/2], [K/2])``: in a
    superblock whose vectors are ``W = L / 8`` bytes, bytes ``u*W .. u*W + W-1`` hold kernel-order
    vector 2u in their low nibbles and vector 2u + 1 in their high ones."""
    order, lo, hi = kernel_order(k), [], []
    for k0 in range(0, k, SUPERBLOCK):
        n = min(SUPERBLOCK, k - k0)
        pos = (k0 + torch.arange(n)).view(4, 2, n // 8)
        lo.append(order[pos[:, 0].reshape(-1)])
        hi.append(order[pos[:, 1].reshape(-1)])
    return torch.cat(lo), torch.cat(hi)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 ``[N, K]`` in column order (K % 64 == 0) -> packed ``[N, K / 2]`` in the
    kernels' order (:func:`kernel_order`, two kernel-order vectors per 32 bytes)."""
    lo, hi = _nibble_columns(q.shape[1])
    q = q.to(torch.uint8)
    return (q[:, lo] | (q[:, hi] << 4)).contiguous()


def unpack_int4(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[N, K / 2]`` -> uint8 ``[N, K]`` in column order."""
    n, half = qs.shape
    lo, hi = _nibble_columns(half * 2)
    q = torch.empty(n, half * 2, dtype=torch.uint8)
    q[:, lo] = qs & 0x0F
    q[:, hi] = qs >> 4
    return q


def _unpack_gguf_q4(qs: np.ndarray) -> torch.Tensor:
    """GGUF Q4_K's nibbles ``[N, K / 2]`` (per 64 values: 32 bytes, low nibbles the first 32
    values, high nibbles the next 32) -> uint8 ``[N, K]`` in column order."""
    n, half = qs.shape
    v = torch.from_numpy(np.ascontiguousarray(qs)).view(n, half // 32, 1, 32)
    return torch.cat([v & 0x0F, v >> 4], dim=2).reshape(n, half * 2)


def check_packable(name: str, shape, layout: str) -> None:
    """Raise ValueError naming tensor ``name`` when ``layout`` cannot hold its shape."""
    k = int(shape[1])
    multiple = 64 if layout == "int4" else 32
    if k % multiple:
        raise ValueError(f"quantization {layout} cannot pack tensor {name!r} of shape {tuple(int(s) for s in shape)}: "
                         f"in_features {k} is not a multiple of {multiple}")


def _superblock_max(v: torch.Tensor, per_super: int) -> torch.Tensor:
    """``[N, J]`` sub-block values -> ``[N, S]`` maxima over each superblock's sub-blocks."""
    n, j = v.shape
    s = -(-j // per_super)
    padded = torch.zeros(n, s * per_super, dtype=v.dtype)
    padded[:, :j] = v
    return padded.reshape(n, s, per_super).amax(dim=2)


def quantize(w: torch.Tensor, layout: str, name: str = "weight") -> QuantizedTensor:
    """Quantize a float ``[N, K]`` weight into ``layout`` ("int8" or "int4").

    int8: per 16 values an ideal scale ``amax / 127``, stored as int8 multiples of the superblock's
    ``d = max(scale) / 127``. int4: per 32 values ``min <= 0 <= max`` mapped onto 0..15, scale and
    min stored as 8-bit multiples of the superblock's ``d`` / ``dmin``. Sub-block scales and mins
    are rounded up, so no value is clipped: every weight is within half a step.

    Raises:
        ValueError: a shape the layout cannot pack (naming ``name``).
    """
    check_packable(name, w.shape, layout)
    w = w.detach().to(torch.float32).cpu()
    n, k = w.shape
    if layout == "int8":
        amax = w.reshape(n, k // 16, 16).abs().amax(dim=2)                 # [N, K/16]
        ideal = amax / 127.0
        d = _superblock_max(ideal, SUPERBLOCK // 16) / 127.0                # [N, S]
        dj = d.repeat_interleave(SUPERBLOCK // 16, dim=1)[:, : k // 16]
        # rounded up, so that no value of the sub-block is clipped
        sc = torch.where(dj > 0, torch.ceil(ideal / torch.where(dj > 0, dj, 1) - 1e-4), 0).clamp(0, 127)
        step = (dj * sc).repeat_interleave(16, dim=1)                       # [N, K]
        q = torch.where(step > 0, torch.round(w / torch.where(step > 0, step, 1)), 0).clamp(-127, 127)
        return QuantizedTensor("int8", q.to(torch.int8)[:, kernel_order(k)].contiguous(), sc.to(torch.int8).contiguous(),
                               None, d.contiguous(), None)
    if layout != "int4":
        raise ValueError(f"unknown quantization layout {layout!r}")
    blocks = w.reshape(n, k // 32, 32)
    lo = blocks.amin(dim=2).clamp(max=0)                                    # [N, K/32]
    hi = blocks.amax(dim=2).clamp(min=0)
    per = SUPERBLOCK // 32
    # mins first (rounded up: every value + offset >= 0), then scales covering the rounded range
    dmin = _superblock_max(-lo, per) / 255.0
    mj = dmin.repeat_interleave(per, dim=1)[:, : k // 32]
    mn = torch.where(mj > 0, torch.ceil(-lo / torch.where(mj > 0, mj, 1) - 1e-4), 0).clamp(0, 255)
    ideal_scale = (hi + mj * mn) / 15.0
    d = _superblock_max(ideal_scale, per) / 255.0
    dj = d.repeat_interleave(per, dim=1)[:, : k // 32]
    sc = torch.where(dj > 0, torch.ceil(ideal_scale / torch.where(dj > 0, dj, 1) - 1e-4), 0).clamp(0, 255)
    step = (dj * sc).unsqueeze(2)
    offset = (mj * mn).unsqueeze(2)
    q = torch.where(step > 0, torch.round((blocks + offset) / torch.where(step > 0, step, 1)), 0).clamp(0, 15)
    return QuantizedTensor("int4", pack_int4(q.reshape(n, k)).contiguous(), sc.to(torch.uint8).contiguous(),
                           mn.to(torch.uint8).contiguous(), d.contiguous(), dmin.contiguous())


# --------------------------------------------------------------------------------------- GGUF

def layout_for(quantization: str, gguf_type: str, keep_file_precision: bool = True) -> str | None:
    """The layout a GGUF tensor of ``gguf_type`` takes under ``quantization`` (None: stays float).

    ``keep_file_precision``: under int4, tensors the file keeps above ~4.5 bits go to int8 (a
    target's choice); False puts every tensor in the asked layout (a draft's: cheapest).
    """
    if quantization == "none":
        return None
    if quantization == "int8" or not keep_file_precision:
        return quantization
    if gguf_type == "Q6_K":   # its own 6-bit integers: the file's bytes per weight
        return "int6"
    return "int8" if gguf_type in _HIGH_PRECISION_GGUF - _FLOAT_GGUF else "int4"


def from_gguf(name: str, raw: np.ndarray, gguf_type: str, shape: tuple[int, int], layout: str,
              dequantize) -> QuantizedTensor:
    """One GGUF weight (``raw``: its block bytes, ``[N, bytes per row]``) in ``layout``.

    ``Q4_K`` -> int4 and ``Q6_K`` -> int6 / int8 copy the file's integers and scales (exact); any
    other pair goes through the tensor's float values (``dequantize(raw, type) -> float32``), one
    tensor at a time, so no float copy of the whole model is ever built (int6 then falls back to
    int8: only Q6_K blocks give 6-bit integers).
    """
    import gguf

    n, k = shape
    check_packable(name, shape, layout)
    if n > _ROWS_PER_CHUNK:  # bound the float temporaries (an output head is 151936 rows)
        return QuantizedTensor.cat([
            from_gguf(name, raw[i:i + _ROWS_PER_CHUNK], gguf_type, (min(_ROWS_PER_CHUNK, n - i), k), layout,
                      dequantize) for i in range(0, n, _ROWS_PER_CHUNK)])
    if gguf_type == "Q4_K" and layout == "int4" and k % SUPERBLOCK == 0:
        blocks = np.ascontiguousarray(raw).reshape(n * (k // SUPERBLOCK), 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, -1)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, -1)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        qs = pack_int4(_unpack_gguf_q4(blocks[:, 16:144].reshape(n, k // 2)))   # the file's integers, reordered
        t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1).astype(dt))
        return QuantizedTensor("int4", qs, t(sc, np.uint8), t(mn, np.uint8), t(d, np.float32),
                               t(dmin, np.float32), "Q4_K")
    values = dequantize(raw, getattr(gguf.GGMLQuantizationType, gguf_type)).reshape(n, k)
    if gguf_type == "Q6_K" and layout in ("int6", "int8") and k % SUPERBLOCK == 0:
        blocks = np.ascontiguousarray(raw).reshape(n * (k // SUPERBLOCK), 210)
        sc = blocks[:, 192:208].copy().view(np.int8).reshape(n, k // 16)
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32).reshape(n, -1)
        step = np.repeat(np.repeat(d, SUPERBLOCK // 16, axis=1) * sc, 16, axis=1)   # [N, K] float32
        q = np.where(step != 0, np.rint(values / np.where(step != 0, step, 1)), 0)
        qs = torch.from_numpy(q.astype(np.int8))[:, kernel_order(k)].contiguous()
        return QuantizedTensor(layout, qs, torch.from_numpy(sc.copy()), None,
                               torch.from_numpy(np.ascontiguousarray(d)), None, "Q6_K")
    qt = quantize(torch.from_numpy(np.ascontiguousarray(values)), "int8" if layout == "int6" else layout, name)
    qt.source = gguf_type
    return qt


# --------------------------------------------------------------------------------------- reference

def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization in PyTorch: ``x [M, K]`` float32 ->
    ``(xq int8 [M, K], dx float32 [M, S])`` with per-superblock ``dx = amax / 127``."""
    m, k = x.shape
    s = -(-k // SUPERBLOCK)
    xq = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, s, dtype=torch.float32)
    for i in range(s):
        part = x[:, i * SUPERBLOCK:(i + 1) * SUPERBLOCK].float()
        amax = part.abs().amax(dim=1, keepdim=True)
        inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, 1), 0)
        xq[:, i * SUPERBLOCK:(i + 1) * SUPERBLOCK] = torch.round(part * inv).clamp(-127, 127).to(torch.int8)
        dx[:, i] = (amax / 127.0).squeeze(1)
    return xq, dx


def reference_matmul(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in float64: ``dequant(quantize_rows(x)) @ dequant(w).T + bias``.

    ``x [M, K]`` float32 -> ``[M, N]`` float64.
    """
    xq, dx = quantize_rows_reference(x)
    x_hat = xq.double() * dx.double().repeat_interleave(SUPERBLOCK, dim=1)[:, : x.shape[1]]
    w_hat = w.dequantize(torch.float64)
    y = x_hat @ w_hat.T
    return y if bias is None else y + bias.double()


def to_device(weights: dict, device, dtype: torch.dtype) -> dict:
    """Float tensors of a weights dict moved to ``device`` / ``dtype``; quantized ones kept (CPU)."""
    return {k: v if isinstance(v, QuantizedTensor) else v.to(device=device, dtype=dtype) for k, v in weights.items()}
