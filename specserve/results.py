"""Result files (benchmark and evaluation JSON) written the same way everywhere.

Results are committed beside the docs, so paths under the user's home directory are written as
``~/...``: a file then names the same place on every machine and no machine's user.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any


def home_relative(obj: Any) -> Any:
    """``obj`` with the home directory written as ``~`` wherever a path starts with it: a string
    that is such a path, or one that holds it after a space, ``=``, ``:`` or a quote (a recorded
    command line). Dicts, lists and tuples are walked recursively; other values returned as they are."""
    home = os.path.expanduser("~").rstrip("/")
    if not home:
        return obj
    pattern = re.compile(r"(^|(?<=[\s=:'\"]))" + re.escape(home) + r"(?=/|$|[\s'\"])")
    return _rewrite(obj, pattern)


def _rewrite(obj: Any, pattern: re.Pattern) -> Any:
    if isinstance(obj, str):
        return pattern.sub("~", obj)
    if isinstance(obj, dict):
        return {k: _rewrite(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rewrite(v, pattern) for v in obj]
    return obj


def write_json(path: str | os.PathLike, result: dict) -> None:
    """Write ``result`` to ``path`` as indented JSON (parents created), home paths as ``~/...``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(home_relative(result), indent=1) + "\n")
