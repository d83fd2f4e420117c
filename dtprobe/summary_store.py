"""The stored Overview of a finished run or a trace folder (``dtprobe.summary/1``): computed once, when the run
ends (``dtprobe run``, ``dtprobe compact``) or at its first view in the dashboard, and read by the dashboard
instead of analyzing the source again. Format: docs/run-store.md.

A stored summary is valid only for the key it was made under: the state of the files the analysis reads (path,
size and mtime of each), dtprobe's version and the analysis options. Anything else (a run that changed, another
version, other options, a damaged or foreign file) is recomputed, never shown. ``dtprobe run`` and
``dtprobe compact`` store a run's summary in the run directory (``summary.json``); the dashboard, which only
reads the folders it shows, stores what it made in the per-user cache (``$XDG_CACHE_HOME/dtprobe/summaries``,
default ``~/.cache/dtprobe/summaries``), as it does for trace folders. A running run has none.

Beside a summary, the analysis results its pages read back instead of computing them again (every finding with its
evidence rows, the straggler scores: ``dtprobe.analysis.kept``), in ``<summary file>.kept/`` under the same key.

The per-user cache is bounded (``cache_limit_bytes``): each store there removes the entries of folders that are
gone, then the least recently used ones until the rest fit (``prune_cache``); a summary read from it counts as a
use.

No Streamlit, and the analysis modules (pandas) are imported only to make a summary or its key, or to read the
results kept beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtprobe import __version__
from dtprobe.overview import Overview
from dtprobe.store.errors import ConfigError
from dtprobe.store.manifest import folder_bytes, write_text_atomically

if TYPE_CHECKING:
    from dtprobe.analysis.facade import AnalysisOptions

SCHEMA = "dtprobe.summary/1"
"""Value of the ``schema`` key of a stored summary."""
SUMMARY_FILE = "summary.json"
"""A run's stored summary: ``<run>/summary.json``."""
CACHE_ENV = "XDG_CACHE_HOME"
"""Where the per-user cache lives (``$XDG_CACHE_HOME/dtprobe/summaries``; unset: ``~/.cache``)."""
CACHE_LIMIT_ENV = "DTPROBE_CACHE_MAX_MB"
"""The per-user cache's bound in MB (``cache_limit_bytes``)."""
DEFAULT_CACHE_MAX_MB = 1024
"""The bound without ``DTPROBE_CACHE_MAX_MB``: summaries are tens of KB, a large folder's kept results a few MB."""
RUN_INPUTS = ("run.json", "ranks", "events", "tables", "traces")
"""What the analysis of a run reads, under the run directory (the state a summary is keyed by)."""


def is_run(path: Path) -> bool:
    return (path / "run.json").is_file()


def cache_dir() -> Path:
    """The per-user folder of stored summaries of trace folders and read-only runs."""
    base = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache")
    return Path(base) / "dtprobe" / "summaries"


def cache_limit_bytes() -> int:
    """How many bytes the per-user cache may hold (summaries and their kept results): ``DTPROBE_CACHE_MAX_MB``, else
    ``DEFAULT_CACHE_MAX_MB``. Raises ConfigError naming the variable for a value that is not a whole number >= 0
    (the dashboard shows it as it shows a bad run)."""
    value = os.environ.get(CACHE_LIMIT_ENV, "").strip()
    if not value:
        return DEFAULT_CACHE_MAX_MB << 20
    if not value.isdigit():
        raise ConfigError(f"{CACHE_LIMIT_ENV}={value!r}: give the per-user summary cache's size in whole MB "
                         f"(e.g. {DEFAULT_CACHE_MAX_MB}), or unset it for {DEFAULT_CACHE_MAX_MB} MB")
    return int(value) << 20


_CACHE_ENTRY = re.compile(r"[0-9a-f]{32}\.(json|kept)")
"""A per-user cache entry's file or folder name (``_cache_file``; what the prune may remove)."""


def prune_cache(*, keep: Path | None = None, max_bytes: int | None = None) -> list[Path]:
    """Bound the per-user cache: remove each entry (a summary file with its ``.kept`` folder) whose folder is gone
    or whose summary cannot be read, each ``.kept`` folder without its summary, then the least recently used
    entries (oldest mtime: ``load`` touches what it reads) until the rest hold at most ``max_bytes`` (default
    ``cache_limit_bytes()``). ``keep`` (the entry just stored) stays. Returns the summary files removed."""
    limit = cache_limit_bytes() if max_bytes is None else max_bytes
    folder = cache_dir()
    try:
        names = [n for n in os.listdir(folder) if _CACHE_ENTRY.fullmatch(n)]
    except OSError:
        return []
    removed: list[Path] = []
    entries: list[tuple[int, Path, int]] = []
    for name in names:
        item = folder / name
        if name.endswith(".kept"):
            if not item.with_suffix(".json").exists():
                shutil.rmtree(item, ignore_errors=True)
            continue
        try:
            st = item.stat()
        except OSError:   # removed meanwhile by another process' prune
            continue
        if item != keep and not _source_exists(item):
            _remove_entry(item)
            removed.append(item)
            continue
        entries.append((st.st_mtime_ns, item, st.st_size + folder_bytes(_kept_dir(item))))
    total = sum(size for _, _, size in entries)
    for _, item, size in sorted(entries):
        if total <= limit:
            break
        if item != keep:
            _remove_entry(item)
            removed.append(item)
            total -= size
    return removed


def _source_exists(summary_file: Path) -> bool:
    """Whether the folder a stored summary is of still exists (False for a summary that cannot be read)."""
    try:
        source = json.loads(summary_file.read_bytes()).get("path")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(source, str) and Path(source).exists()


def _remove_entry(summary_file: Path) -> None:
    shutil.rmtree(_kept_dir(summary_file), ignore_errors=True)
    summary_file.unlink(missing_ok=True)


def state_of(path: str | os.PathLike) -> str:
    """A digest of the files the analysis of the run or trace folder at ``path`` reads: each one's relative path,
    size and mtime (a few ``stat`` calls per file, no file read)."""
    path = Path(path)
    roots = [path / name for name in RUN_INPUTS] if is_run(path) else [path]
    entries = []
    for root in roots:
        if root.is_file():
            entries.append(_stat_line(str(root), root.name))
            continue
        # plain strings, not a Path per file: a compacted 1,024-rank run has tens of thousands of files
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            rel = os.path.relpath(folder, path)
            prefix = "" if rel == os.curdir else rel + os.sep
            for name in sorted(files):
                entries.append(_stat_line(os.path.join(folder, name), prefix + name))
    return hashlib.sha256("\n".join(e for e in entries if e).encode()).hexdigest()


def _stat_line(file: str, relative: str) -> str:
    try:
        st = os.stat(file)
    except FileNotFoundError:  # removed while listed (a compaction swapping tables/): part of another state
        return ""
    return f"{relative}\t{st.st_size}\t{st.st_mtime_ns}"


@functools.cache
def analysis_code() -> str:
    """SHA-256 (32 hex) of the code that makes a summary (``dtprobe/analysis``, ``dtprobe/store``: the tables it
    reads, ``dtprobe/overview.py``): a summary made by other code, a detector or a reader changed under the same
    version number (a development install), is made again, not shown."""
    return code_digest(Path(__file__).resolve().parent)


def code_digest(root: Path) -> str:
    """``analysis_code`` of the package at ``root`` (its ``analysis/*.py``, ``store/*.py`` and ``overview.py``)."""
    digest = hashlib.sha256()
    for file in sorted([*(root / "analysis").glob("*.py"), *(root / "store").glob("*.py"), root / "overview.py"]):
        digest.update(f"{file.relative_to(root).as_posix()}\0".encode() + file.read_bytes())
    return digest.hexdigest()[:32]


def key_of(path: str | os.PathLike, options: AnalysisOptions | None = None) -> dict[str, Any]:
    """What a summary of ``path`` made now is valid for: the files' state, dtprobe's version and analysis code,
    the options."""
    from dtprobe.analysis.facade import AnalysisOptions

    key = {"state": state_of(path), "dtprobe_version": __version__, "analysis_code": analysis_code(),
           "options": dataclasses.asdict(options or AnalysisOptions())}
    return json.loads(json.dumps(key))  # as it reads back from the file (tuples become lists)


def _cache_file(path: Path) -> Path:
    return cache_dir() / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")


def _candidates(path: Path) -> list[Path]:
    """Where a summary of ``path`` may be stored, in the order they are read."""
    return [path / SUMMARY_FILE, _cache_file(path)] if is_run(path) else [_cache_file(path)]


def is_finished(path: Path) -> bool:
    """A trace folder, or a run whose status is not ``running`` (only those have a stored summary)."""
    if not is_run(path):
        return True
    try:
        status = json.loads((path / "run.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return False  # an unreadable manifest: the analysis reports it
    return status != "running"


def load(path: str | os.PathLike, *, key: dict[str, Any] | None = None,
         options: AnalysisOptions | None = None) -> Overview | None:
    """The stored Overview of the finished run or trace folder at ``path`` if one is valid for ``key`` (default:
    ``key_of(path, options)``), else None."""
    path = Path(path).resolve()
    if not is_finished(path):
        return None
    for file in _candidates(path):
        try:
            doc = json.loads(file.read_bytes())
        except (OSError, ValueError):  # none yet, unreadable or damaged: made again
            continue
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("path") != str(path):
            continue
        key = key or key_of(path, options)   # only once a summary is found: it stats every file of the run
        if doc.get("key") != key:
            continue
        try:
            overview = Overview.from_dict(doc.get("overview"))
        except ValueError:
            continue
        if overview.whole and overview.path == str(path):
            if file.parent == cache_dir():
                _touch(file)
            return overview
    return None


def _touch(file: Path) -> None:
    """Mark a per-user cache entry as used now (``prune_cache`` removes the least recently used first)."""
    try:
        os.utime(file)
    except OSError:   # a read-only cache: it is never pruned from here either
        pass


def store(path: str | os.PathLike, overview: Overview, *, key: dict[str, Any], in_run_dir: bool = False,
          kept: dict[str, Any] | None = None) -> Path | None:
    """Store ``overview`` of the finished run or trace folder at ``path`` under ``key`` (made before the source
    was read, so that a change while it was analyzed makes it stale): in the per-user cache, or with
    ``in_run_dir`` in the run directory when it is a writable run; and beside it the analysis results ``kept``
    (``RunAnalysis.kept_results()``: in ``<summary file>.kept/``, see ``dtprobe.analysis.kept``). Returns the
    file, or None when the Overview covers only some steps or nowhere is writable (the summary is a cache: the
    next view makes it again)."""
    path = Path(path).resolve()
    if not overview.whole or not is_finished(path):
        return None
    doc = json.dumps({"schema": SCHEMA, "path": str(path), "key": key, "overview": overview.to_dict()})
    places = _candidates(path) if in_run_dir else [_cache_file(path)]
    for file in places:
        try:
            write_text_atomically(file, doc)
        except OSError:
            continue  # a read-only run folder or cache: try the next place
        if kept is not None:
            from dtprobe.analysis import kept as kept_results

            kept_results.write(_kept_dir(file), kept, source=str(path), key=key)
        if file.parent == cache_dir():
            prune_cache(keep=file)
        return file
    return None


def _kept_dir(summary_file: Path) -> Path:
    return summary_file.with_suffix(".kept")


def load_kept(path: str | os.PathLike, *, key: dict[str, Any] | None = None,
              options: AnalysisOptions | None = None):
    """The analysis results kept beside a stored summary of the finished run or trace folder at ``path``
    (``dtprobe.analysis.kept.Kept``) when they are valid for ``key`` (default: ``key_of(path, options)``), else
    None."""
    from dtprobe.analysis import kept as kept_results

    path = Path(path).resolve()
    if not is_finished(path):
        return None
    folders = [_kept_dir(file) for file in _candidates(path)]
    if not any(folder.is_dir() for folder in folders):
        return None
    key = key or key_of(path, options)
    for folder in folders:
        found = kept_results.read(folder, source=str(path), key=key)
        if found is not None:
            return found
    return None


def make(path: str | os.PathLike, *, options: AnalysisOptions | None = None, in_run_dir: bool = True) -> Overview:
    """Analyze the whole source at ``path`` and return its Overview, stored when the source is finished (see
    ``store``). Raises TraceError for unusable data."""
    from dtprobe.analysis.facade import RunAnalysis, open_source
    from dtprobe.overview import summarize

    path = Path(path).resolve()
    key = key_of(path, options)
    analysis = RunAnalysis(open_source(path), options=options)
    overview = summarize(analysis, path=str(path))
    store(path, overview, key=key, in_run_dir=in_run_dir, kept=analysis.kept_results())
    return overview
