"""Result files (benchmark and evaluation JSON) written the same way everywhere.

Results are committed beside the docs, so paths under the user's home directory are written as
``~/...``: a file then names the same place on every machine and no machine's user.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def home_relative(obj: Any) -> Any:
    """``obj`` with every string that starts with the home directory rewritten to start with ``~``
    (dicts, lists and tuples walked recursively; other values returned as they are)."""
    home = os.path.expanduser("~").rstrip("/")
    if isinstance(obj, str):
        return "~" + obj[len(home):] if home and (obj == home or obj.startswith(home + "/")) else obj
    if isinstance(obj, dict):
        return {k: home_relative(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [home_relative(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, result: dict) -> None:
    """Write ``result`` to ``path`` as indented JSON (parents created), home paths as ``~/...``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(home_relative(result), indent=1) + "\n")
