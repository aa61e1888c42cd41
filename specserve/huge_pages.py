"""Transparent huge pages for PyTorch's large CPU tensors, asked for before torch starts.

``specserve train-head`` serves every allocation of 64 KiB or more with its own mapping, unmapped
when freed (``training.trainer.return_freed_memory_to_the_os``: without it a long run's heap only
grew). A step's large tensors (logits of 4 x 512 tokens by the draft vocabulary, 134 MB in float32,
and their gradients) are then mapped anew every step and faulted in page by page: with 4 KiB pages
that cost the EAGLE-3 head of the int4 1.5B target a third of its CPU time in the kernel. PyTorch's
CPU allocator can align tensors of 2 MiB and more to 2 MiB and ``madvise(MADV_HUGEPAGE)`` them
(``THP_MEM_ALLOC_ENABLE``), one fault per 2 MiB instead of 512. Measured (docs/history/benchmarks-before-packing.md, piece 10,
a kernel with transparent huge pages in ``madvise`` mode): 43.5 M -> 8.8 M faults and 7.88 -> 5.54 s
a step, the same losses bit for bit, the same peak memory; engine decoding moved less than that
machine's run-to-run spread. Where the kernel's mode is ``always`` the allocations get huge pages
anyway, and under ``never`` nothing changes.

PyTorch reads the variable once, at its first CPU allocation of 2 MiB or more (checked: set after
such an allocation it changes nothing; set after ``import torch`` alone it still works). Whether
that allocation has happened cannot be seen from outside, so the variable is set only before torch
is imported: the command line does it first thing (``python -m specserve.benchmarks.<name>`` and
library users do not go through it).
"""
from __future__ import annotations

import os
import sys

ENV = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> bool:
    """Ask for huge pages for PyTorch's CPU tensors of 2 MiB and more, unless the user set
    ``THP_MEM_ALLOC_ENABLE`` (kept as given) or torch is already imported (it may have read the
    variable already: changes nothing).

    Returns whether the variable is now on for torch's allocator. Where the kernel's transparent
    huge pages are ``never``, madvise is a no-op and nothing changes but the 2 MiB alignment.
    """
    if "torch" in sys.modules:
        return False
    os.environ.setdefault(ENV, "1")
    return os.environ[ENV] == "1"
