"""The machine a benchmark runs on (CPU, core and thread counts, versions) and how busy it is (load
averages), recorded beside every benchmark's figures."""
from __future__ import annotations

import os
import platform

import torch


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (other processes competing for the cores), if the OS tells."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
