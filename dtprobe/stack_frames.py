"""Frames of the Python stacks a failed or stuck rank leaves (a traceback, faulthandler's dump, the hang
watchdog's ``thread_stacks``): which line of the user's own code a frame is; and torch's message for a
DataLoader worker process that died under a rank. Read by the launcher's stderr excerpt and attempt records
(``runtime.attempts``) and the crash and hang verdicts."""

from __future__ import annotations

import functools
import re

FRAME = re.compile(r'^(\[rank\d+\]:)?\s*File "(?P<path>[^"]+)", line (?P<line>\d+)')
"""A frame line as traceback and faulthandler write it (``File "path", line N, in f`` / ``... line N in f``),
also behind torchrun's ``[rankN]:`` prefix."""


@functools.lru_cache(maxsize=None)
def _library_roots(own: bool) -> tuple[str, ...]:
    import importlib.util
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if own:                                    # dtprobe's package and its collectors (a folder of their own)
        for name in ("dtprobe", "dtprobe.collectors"):
            spec = importlib.util.find_spec(name)
            if spec is not None:
                roots.update(spec.submodule_search_locations or ())
    return tuple(root.rstrip("/") + "/" for root in roots)


def is_library(path: str, *, own: bool = False) -> bool:
    """A frame's file is frozen or of the Python installation (standard library, site-packages); with ``own``, also
    of dtprobe (its launcher and collectors run the script)."""
    return path.startswith("<") or path.startswith(_library_roots(own))


def location(match: re.Match) -> str:
    """``train.py:88`` of a ``FRAME`` match."""
    return f"{match['path'].rsplit('/', 1)[-1]}:{match['line']}"


DATALOADER_WORKER_DIED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? (?P<pids>\d+(?:, \d+)*)\) (?:is killed by signal: (?P<signal>[^.]+)|exited "
    r"unexpectedly)")
"""The error a rank raises when a worker process of its DataLoader died (torch 2.x: ``DataLoader worker (pid 123)
is killed by signal: Killed.``, ``... (pid(s) 123, 124) exited unexpectedly``, ``... (pid 123) exited
unexpectedly with exit code 1``): the pids, and the signal's description when one killed it."""


def dataloader_worker_pids(text: str | None) -> list[int]:
    """The pids of the DataLoader workers ``text`` says died (empty when it says none)."""
    match = DATALOADER_WORKER_DIED.search(text or "")
    return [int(p) for p in match.group("pids").split(", ")] if match else []
