"""Another commit's CPU kernels, built beside this checkout's, for side-by-side timings.

``scripts/roofline.py --against COMMIT`` times the int4 / int8 linears of that commit against this
checkout's on the machine's roofline; ``scripts/kernel_ab_engine.py`` the whole int4 target;
``scripts/attention_bench.py`` the paged attention. This module builds the other commit's source.
"""
import subprocess
import tempfile
from pathlib import Path

from specserve.kernels import build_attention_ops, build_quant_ops, cpu_has_vnni


def other_source(commit: str, name: str = "quant_linear.cpp") -> Path:
    """``specserve/kernels/<name>`` as of ``commit``, written to a new temporary folder."""
    src = subprocess.run(["git", "show", f"{commit}:specserve/kernels/{name}"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="kernel_bench_")) / name
    path.write_text(src)
    return path


def build_other(commit: str):
    """``commit``'s int4 / int8 kernels, with the vector width that commit chose: commits before the
    packed layout ran 512-bit vectors on Intel CPUs only."""
    from specserve.kernels import _cpu_info

    intel = _cpu_info()[0] == "GenuineIntel"
    return build_quant_ops(vnni=cpu_has_vnni(), source=other_source(commit), zmm=intel and cpu_has_vnni())


def build_other_attention(commit: str):
    return build_attention_ops(other_source(commit, "paged_attention.cpp"))
