"""Where specserve keeps what it builds once and reuses: converted weights, assembled model files,
compiled kernels, head data, draft vocabularies (``$SPECSERVE_CACHE``, else ``~/.cache/specserve``).

Its own module so that the kernels, the loader and the tools find the cache without importing
each other.
"""
from __future__ import annotations

import os


def default_cache_dir() -> str:
    """``$SPECSERVE_CACHE`` if set, else ``~/.cache/specserve`` (not created here)."""
    env = os.environ.get("SPECSERVE_CACHE")
    return os.path.expanduser(env) if env else os.path.join(os.path.expanduser("~"), ".cache", "specserve")
