"""The trained draft heads that ship in the package (``specserve/heads/<name>/``), and which
target each one belongs to. A leaf module: the configs resolve ``method="mtp"`` / ``"eagle"``
without a ``model`` to the target's shipped head here, before any model code is imported."""
from __future__ import annotations

from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parent / "heads"


def builtin_heads() -> list[str]:
    """Names of the trained draft heads shipped in the package (``specserve/heads/<name>/``)."""
    if not HEADS_DIR.is_dir():
        return []
    return sorted(p.name for p in HEADS_DIR.iterdir() if (p / "config.json").is_file())


def shipped_head_for(target: str) -> str | None:
    """The shipped head trained for ``target`` (a built-in name, or a path whose file or folder
    name is one: ``<target>-head``), or None. Heads ship with their target as DeepSeek-V3's MTP
    layers do, so ``method="mtp"`` / ``"eagle"`` need no ``model``."""
    name = Path(str(target)).name.removesuffix(".gguf")
    return f"{name}-head" if f"{name}-head" in builtin_heads() else None
