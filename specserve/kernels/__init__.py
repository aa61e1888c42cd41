"""Our own CPU kernels, compiled on first use (``torch.utils.cpp_extension``, cached on disk).

``quant_linear.cpp`` holds the batch-invariant int8 / int4 linears of
:mod:`specserve.models.quantization`: integer dot products (AVX2, or AVX-512 VNNI where the CPU
has it: the same integers, so the same bits) over k-quant weight layouts (llama.cpp's Q4_K / Q6_K
superblocks, repacked at load with 16 weight rows interleaved) and per-row int8 activations. Why our own kernel and not a
library one is recorded in ``docs/quantization.md``.

``paged_attention.cpp`` holds the batch-invariant paged attention of
:mod:`specserve.attention.cpu_backend`: one call per layer, one task per (row, kv head).

The first call compiles an extension (about a minute, needs a C++ compiler and ``ninja``) into
``<cache>/kernels/<key>`` (``$SPECSERVE_CACHE`` or ``~/.cache/specserve``); later processes load it.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_linear.cpp")
_ATTENTION_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
_lock = threading.Lock()
_modules: dict[str, object] = {}   # loaded extensions by name, one per process


class KernelUnavailableError(ValueError):
    """The quantized kernels cannot run here (no AVX2 CPU, not a CPU tensor, or no compiler)."""


def cpu_supports_quantized() -> bool:
    """Whether this CPU has the AVX2 instructions the int8 / int4 kernels use."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cpu_info() -> tuple[str, set[str]]:
    """``(vendor_id, flags)`` of the first CPU in ``/proc/cpuinfo`` (``("", set())`` where it cannot
    be read)."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    return vendor, set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return vendor, flags


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI with 256-bit vectors (AVX512VL), which the kernels use
    when present (read from ``/proc/cpuinfo``; False where it cannot be read)."""
    return {"avx512_vnni", "avx512vl", "avx512bw"} <= _cpu_info()[1]


def cpu_runs_512bit_at_full_width() -> bool:
    """Whether the kernels should run on 512-bit vectors (16 weight rows per vector instead of 8).
    Intel's AVX-512 CPUs and AMD's Zen 5 (family 26) execute them at full width (on a Zen 5 the
    512-bit build ran 1.1-1.6x the 256-bit one at 1-8 rows); Zen 4 (family 25) splits each into two
    256-bit halves (docs/history/kernels-before-packing.md, "512-bit int4 superblocks on Intel
    AVX-512")."""
    vendor, flags = _cpu_info()
    if not {"avx512_vnni", "avx512vl", "avx512bw"} <= flags:
        return False
    return vendor == "GenuineIntel" or (vendor == "AuthenticAMD" and _cpu_family() >= 26)


def _cpu_family() -> int:
    """The first CPU's ``cpu family`` in ``/proc/cpuinfo`` (0 where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu family"):
                    return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return 0


def quant_ops():
    """The compiled extension module (``quantize_rows``, ``q4_matmul``, ``q8_matmul``).

    Raises:
        KernelUnavailableError: no AVX2 on this CPU, or the extension does not build (the message
            carries the compiler's last line).
    """
    return _load_once("quant_linear", "quantized linears", "use quantization 'none'",
                      lambda: build_quant_ops(vnni=cpu_has_vnni()))


def _load_once(name: str, what: str, advice: str, build):
    """``build()``'s module, built once per process (thread-safe), on CPUs with AVX2 only.

    Raises:
        KernelUnavailableError: no AVX2 on this CPU (naming ``what`` and ``advice``), or ``build``'s.
    """
    module = _modules.get(name)
    if module is not None:
        return module
    with _lock:
        if name not in _modules:
            if not cpu_supports_quantized():
                raise KernelUnavailableError(
                    f"{what} need an x86 CPU with AVX2; this one reports "
                    f"{torch.backends.cpu.get_cpu_capability()!r}{f' ({advice})' if advice else ''}")
            _modules[name] = build()
        return _modules[name]


def build_quant_ops(vnni: bool, source: Path = _SOURCE, zmm: bool | None = None):
    """Compile (or load from the on-disk cache) the kernels, with the AVX-512 VNNI dot product or
    the AVX2 one: both give the same bits, which tests compare on CPUs that have VNNI. ``zmm``
    (VNNI only; default :func:`cpu_runs_512bit_at_full_width`): 512-bit vectors, the same bits
    again. ``source``: another version of ``quant_linear.cpp`` (``scripts/kernel_bench.py`` times
    one against this).

    Raises:
        KernelUnavailableError: the extension does not build (the compiler's last line).
    """
    flags = list(_AVX2_FLAGS)
    if vnni:   # vpdpbusd: one instruction per 32 products instead of three (same integers)
        flags += ["-mavx512vnni", "-mavx512vl", "-mavx512bw"]
        if cpu_runs_512bit_at_full_width() if zmm is None else zmm:
            flags.append("-DSPECSERVE_ZMM")
    return _build(Path(source), flags, "quant_linear", "or use quantization 'none'")


def attention_ops():
    """The compiled paged-attention extension (``paged_attention``).

    Raises:
        KernelUnavailableError: no AVX2 on this CPU, or the extension does not build.
    """
    return _load_once("paged_attention", "the CPU attention kernels", "", build_attention_ops)


def build_attention_ops(source: Path = _ATTENTION_SOURCE):
    """Compile (or load from the on-disk cache) the paged-attention kernel; ``source``: another
    version of ``paged_attention.cpp`` (``scripts/attention_bench.py`` times one against this).

    Raises:
        KernelUnavailableError: the extension does not build (the compiler's last line).
    """
    return _build(Path(source), list(_AVX2_FLAGS), "paged_attention", "")


def build_directory(source: Path, flags: list[str], stem: str) -> Path:
    """Where ``source`` built with ``flags`` lives: ``<cache>/kernels/<stem>-<key>``, the key a
    hash of the source, the shared headers beside it, torch's version and the flags."""
    from specserve.cache_dir import default_cache_dir

    headers = b"".join(h.read_bytes() for h in sorted(Path(__file__).parent.glob("*.h")))   # included by every source
    key = hashlib.sha256(source.read_bytes() + headers + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]
    return Path(default_cache_dir()) / "kernels" / f"{stem}-{key}"


def _build(source: Path, flags: list[str], stem: str, advice: str):
    """Compile ``source`` with ``flags`` (or load it from the on-disk cache) as its own module.

    Raises:
        KernelUnavailableError: the extension does not build (the compiler's last line).
    """
    from torch.utils import cpp_extension

    build = build_directory(source, flags, stem)
    build.mkdir(parents=True, exist_ok=True)
    key = build.name.rsplit("-", 1)[1]
    try:
        with open(build / "specserve.lock", "w") as held:
            # cpp_extension marks a build with a 'lock' file and waits, without end, while one
            # exists; a process killed mid-build leaves it behind. Builders hold this flock (the
            # kernel drops it when a process dies), so a 'lock' found while holding it is stale.
            # Where the file system has no flock, cpp_extension's own lock is all there is.
            try:
                fcntl.flock(held, fcntl.LOCK_EX)
            except OSError:
                pass
            else:
                (build / "lock").unlink(missing_ok=True)
            # one module name per source and flags: a process may load several
            fresh = not any(build.glob("*.so"))
            if fresh:   # minutes on a fresh machine: say so, since nothing else moves meanwhile
                logger.warning("building the CPU kernels of %s once (cached in %s) ...", source.name, build)
            t0 = time.perf_counter()
            module = cpp_extension.load(name=f"specserve_{stem}_{key}", sources=[str(source)],
                                        extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build),
                                        verbose=bool(os.environ.get("SPECSERVE_VERBOSE_BUILD")))
            if fresh:
                logger.warning("built the CPU kernels of %s in %.0f s", source.name, time.perf_counter() - t0)
            return module
    except Exception as e:  # compiler or ninja missing, build error
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise KernelUnavailableError(f"cannot build the CPU kernels of {source.name} ({last[:300]}); "
                                     f"install a C++ compiler and ninja{', ' + advice if advice else ''}") from None
