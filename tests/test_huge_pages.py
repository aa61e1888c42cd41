"""use_huge_pages: PyTorch's large CPU tensors come with far fewer page faults (counted by the
kernel: getrusage's minor faults), in a fresh process each time since torch reads it once."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import os, resource, sys
if sys.argv[1] == "on":
    from specserve.huge_pages import use_huge_pages
    assert use_huge_pages()
else:
    os.environ["THP_MEM_ALLOC_ENABLE"] = "0"
import torch
numel = 64 << 18   # 64 MiB of float32: above glibc's largest mmap threshold, mapped anew each time
def cycle():
    torch.ones(numel)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    cycle()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (8 * numel * 4 / 4096))
"""


def _run(code: str, env_value: str | None, *args: str) -> list[str]:
    """stdout's words of ``python -c code args...`` with ``THP_MEM_ALLOC_ENABLE`` unset or set."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                          env=env).stdout.split()


def _faults_per_page(mode: str) -> float:
    return float(_run(CHILD, None, mode)[-1])


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs transparent huge pages on madvise")
def test_huge_pages_cut_faults_of_large_tensors():
    off, on = _faults_per_page("off"), _faults_per_page("on")
    assert off > 0.9          # 4 KiB pages: one fault per page, every cycle
    assert on < off / 10      # 2 MiB pages: ideally 1/512 of that (measured ~1/30), while the kernel has huge pages free


def test_use_huge_pages_keeps_the_users_choice_and_does_nothing_once_torch_is_imported():
    ask = "import os\nfrom specserve.huge_pages import use_huge_pages\nprint(use_huge_pages(), os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    assert _run(ask, None) == ["True", "1"]
    assert _run(ask, "0") == ["False", "0"]
    assert _run("import torch\n" + ask, None) == ["False", "None"]


def test_the_command_line_asks_before_torch_loads():
    # the variable is set by the command line's import, whatever loads torch after it (the
    # command line itself imports torch only when a command runs)
    code = ("import sys\nimport specserve.huge_pages\nassert 'torch' not in sys.modules\n"
            "import os, specserve.entrypoints.cli\nwhen_torch_loads = os.environ['THP_MEM_ALLOC_ENABLE']\n"
            "import torch\nprint(when_torch_loads)")
    assert _run(code, None) == ["1"]
