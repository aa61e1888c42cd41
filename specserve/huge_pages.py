"""Transparent huge pages for PyTorch's large CPU tensors, asked for before torch starts.

Every tensor a step allocates and frees above glibc's mmap threshold (at most 32 MiB) is mapped
anew and faulted in page by page: head training allocates such tensors every step (logits of
4 x 512 tokens by the draft vocabulary, 134 MB in float32, and their gradients). With 4 KiB pages
that cost the EAGLE-3 head of the int4 1.5B target ~275,000 faults a second and a third of its CPU
time in the kernel. PyTorch's CPU allocator can align tensors of 2 MiB and more to 2 MiB and
``madvise(MADV_HUGEPAGE)`` them (``THP_MEM_ALLOC_ENABLE``), 512 times fewer faults: measured
(BENCHMARKS.md, "Head training: huge pages") 7.9 -> 5.5 s a step, same losses bit for bit, same
peak memory; engine decoding unchanged within the machine's noise.

PyTorch reads the variable once, at its first allocation, which ``import torch`` makes: hence a
separate module the command line imports before anything imports torch.
"""
from __future__ import annotations

import os
import sys

ENV = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> bool:
    """Ask for huge pages for PyTorch's CPU tensors of 2 MiB and more, unless the user set
    ``THP_MEM_ALLOC_ENABLE`` (kept as given) or torch is already imported (too late: changes nothing).

    Returns whether the variable is now on for torch's allocator. Where the kernel's transparent
    huge pages are ``never``, madvise is a no-op and nothing changes but the 2 MiB alignment.
    """
    if "torch" in sys.modules:
        return False
    os.environ.setdefault(ENV, "1")
    return os.environ[ENV] == "1"
