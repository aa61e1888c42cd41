"""Progress of long work: a tqdm bar on a terminal, log lines elsewhere.

A server's or a batch job's stderr is a file: a bar's carriage-return frames would fill it with
thousands of partial lines. :func:`progress` gives a bar when stderr is a terminal and otherwise an
object with the same ``update`` / ``close`` / context-manager use that logs one line when the work
starts and one when it ends, with its total and time.
"""
from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("specserve.progress")


class LogProgress:
    """tqdm's ``update`` / ``close`` / ``with`` use, as two log lines."""

    def __init__(self, total: float | None = None, desc: str = "", unit: str = "it", **_):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self._t0 = time.perf_counter()
        self._closed = False
        size = f" ({_amount(total, unit)})" if total else ""
        logger.info("%s%s ...", desc or "working", size)

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix_str(self, *_, **__) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            logger.info("%s: done, %s in %.1f s", self.desc or "work", _amount(self.n, self.unit),
                        time.perf_counter() - self._t0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _amount(n: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {prefix}{unit}"
    return f"{n:g} {unit}"


def progress(total: float | None = None, desc: str = "", unit: str = "it", **kw):
    """A tqdm bar over ``total`` units when stderr is a terminal, else a :class:`LogProgress`."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, **kw)
    return LogProgress(total, desc, unit)
