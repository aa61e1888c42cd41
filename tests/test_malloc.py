"""keep_freed_memory: a large block freed and allocated again is reused without new page faults
(counted by the kernel: getrusage's minor faults), in a fresh process each time."""
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys
from specserve.malloc import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
size = 64 << 20   # above glibc's largest mmap threshold (32 MiB)
def cycle():
    b = bytearray(size)
    b[::4096] = b"\x01" * (size // 4096)   # touch every page
    del b
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    cycle()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (8 * size / 4096))
"""


def _faults_per_page(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_reuses_large_blocks_without_faults():
    kept, keep = _faults_per_page("keep")
    if kept != "True":
        pytest.skip("the C library is not glibc")
    _, default = _faults_per_page("default")
    # glibc's default maps the block anew every cycle: a fault per page (4 KiB, or 2 MiB where
    # transparent huge pages are always on); kept, the block stays in the heap with its pages
    assert default >= 0.9 / 512
    assert keep <= default / 20
