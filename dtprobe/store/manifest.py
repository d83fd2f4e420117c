"""The run manifest (``run.json``) and per-rank info files (``ranks/rankNNNNN.json``): written by the launcher,
the attach-mode leader and every rank; read by ``RunStore``, ``list_runs`` and the dashboard.

Every write is atomic (temp file + ``os.replace``), so a reader never sees a half-written JSON file; the
read-modify-write updates (``set_status``, ``add_restart``, ``record_attempt``) also hold an ``fcntl`` lock on
``<run>/.run.json.lock`` so launchers (one per node) and a leader updating the same run do not lose each other's
changes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dtprobe.store.errors import TraceError
from dtprobe.store.schema import (MANIFEST_FILE, OLDEST_SCHEMA_VERSION, RANK_INFO_FILE, RUN_STATUSES,
                                  SCHEMA_VERSION)

RUN_FORMAT = "dtprobe-run"
"""Value of the ``format`` key of every ``run.json`` dtprobe writes (tells ours from someone else's run.json)."""

REQUIRED_MANIFEST_KEYS = ("format", "schema_version", "run_id", "status", "world_size")
REQUIRED_RANK_KEYS = ("rank", "host", "node_rank", "local_rank", "device", "pid", "clock_offset_ns")
_KNOWN_MANIFEST_KEYS = frozenset(
    {"format", "schema_version", "run_id", "status", "world_size", "nnodes", "command", "config",
     "created_ns", "ended_ns", "restarts", "attempts"})
ATTEMPT_RESULTS = ("succeeded", "failed", "interrupted")
"""``result`` of an entry of run.json's ``attempts``."""


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """One rank as it described itself at attach (``ranks/rankNNNNN.json``)."""

    rank: int
    """Global rank."""
    host: str
    """Hostname the rank runs on."""
    node_rank: int
    """Node (torchrun GROUP_RANK) index."""
    local_rank: int
    """Rank within its node."""
    device: str
    """Device string, e.g. ``cuda:3`` or ``cpu``."""
    pid: int
    """Process id of the rank's latest incarnation."""
    clock_offset_ns: int
    """Rank 0's clock minus this rank's clock (ns); the reader adds it to every timestamp of this rank."""
    restart: int = 0
    """torchrun restart count when this file was (re)written."""
    device_name: str | None = None
    """Device model (``torch.cuda.get_device_name``, e.g. ``NVIDIA H100 80GB HBM3``); None on CPU and in files
    written before it was recorded. The peak FLOP/s of MFU is looked up by it."""


@dataclass(frozen=True, kw_only=True)
class Restart:
    """One torchrun restart of the job, as recorded by ``add_restart``."""

    restart: int
    """Restart count after the restart (1 for the first)."""
    time_ns: int
    """When the restart was noticed (rank 0 clock, Unix ns)."""
    steps_lost: int | None
    """Steps recomputed because of the restart (null if unknown)."""
    from_step: int | None
    """Step training resumed from (null if unknown)."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything ``run.json`` and ``ranks/*.json`` say about a run."""

    path: Path
    """The run directory."""
    schema_version: int
    """Store schema version the run was written with."""
    run_id: str
    """Run identifier (usually the directory name)."""
    status: str
    """``running``, ``finished`` or ``crashed``."""
    world_size: int
    """Number of ranks."""
    nnodes: int
    """Number of nodes."""
    command: list[str]
    """Command line that started the run."""
    config: dict[str, Any]
    """Resolved job / collection config (free-form JSON)."""
    created_ns: int | None
    """When the run was created (Unix ns)."""
    ended_ns: int | None
    """When the run finished or crashed (Unix ns), null while running."""
    restarts: tuple[Restart, ...]
    """Restarts in the order recorded."""
    attempts: tuple[dict[str, Any], ...] = ()
    """torchrun attempts, one entry per (attempt, node), sorted by both, as ``record_attempt`` stores them:
    ``{"attempt", "node_rank", "started_ns", "ended_ns", "result", "ranks": [{"rank", "local_rank", "pid",
    "exit_code", "signal", "first_failure", "time_ns", "error"[, "stderr_tail"][, "oom_kill"]}]}``
    (docs/run-store.md). Empty for runs recorded before attempts were (and for ``attach`` runs, which have no
    launcher)."""
    ranks: tuple[RankInfo, ...]
    """Per-rank info, sorted by rank (only ranks that wrote their file)."""
    nodes: tuple[tuple[int, str], ...]
    """Distinct (node_rank, host) pairs from ``ranks``, sorted."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other keys of run.json (e.g. those passed to ``set_status(**extra)``)."""

    def rank_info(self, rank: int) -> RankInfo | None:
        """The info of ``rank``, or None if that rank never wrote ``ranks/rankNNNNN.json``."""
        for info in self.ranks:
            if info.rank == rank:
                return info
        return None

    @property
    def clock_offsets_ns(self) -> dict[int, int]:
        """rank -> clock offset (ns) for every rank with an info file."""
        return {info.rank: info.clock_offset_ns for info in self.ranks}


# ---------------------------------------------------------------------------------------------------- writing


def create_manifest(run_dir: str | os.PathLike, *, run_id: str, command: list[str], config: dict,
                    world_size: int, nnodes: int = 1) -> None:
    """Create ``<run_dir>/run.json`` with status ``running`` (creating the directory; replaces an existing one)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(run_dir / MANIFEST_FILE, {
        "format": RUN_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "run_id": str(run_id),
        "status": "running",
        "world_size": int(world_size),
        "nnodes": int(nnodes),
        "command": [str(c) for c in command],
        "config": config,
        "created_ns": time.time_ns(),
        "ended_ns": None,
        "restarts": [],
        "attempts": [],
    })


def set_status(run_dir: str | os.PathLike, status: str, **extra: Any) -> None:
    """Set the run status (and ``ended_ns`` for finished/crashed); ``extra`` keys are stored in run.json too.

    FileNotFoundError if the run has no run.json yet.
    """
    if status not in RUN_STATUSES:
        raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
    with _locked_manifest(run_dir) as data:
        data["status"] = status
        data["ended_ns"] = time.time_ns() if status in ("finished", "crashed") else None
        data.update(extra)


def add_restart(run_dir: str | os.PathLike, *, restart: int, time_ns: int, steps_lost: int | None,
                from_step: int | None) -> None:
    """Append one restart record to run.json (status goes back to ``running``); FileNotFoundError if none yet."""
    with _locked_manifest(run_dir) as data:
        data.setdefault("restarts", []).append(
            {"restart": int(restart), "time_ns": int(time_ns), "steps_lost": steps_lost, "from_step": from_step})
        data["status"] = "running"
        data["ended_ns"] = None


def record_attempt(run_dir: str | os.PathLike, attempt: dict[str, Any]) -> None:
    """Store one torchrun attempt of one node in run.json's ``attempts`` (replacing an entry with the same
    ``attempt`` and ``node_rank``: a launcher may record an attempt again once it knows more); kept sorted by
    (attempt, node_rank). ``attempt`` has the shape documented on ``Manifest.attempts``. FileNotFoundError if the
    run has no run.json yet; ValueError for a malformed entry (a programming error of the caller)."""
    _check_attempt(attempt)
    key = (int(attempt["attempt"]), int(attempt["node_rank"]))
    with _locked_manifest(run_dir) as data:
        kept = [a for a in data.get("attempts") or [] if (a.get("attempt"), a.get("node_rank")) != key]
        data["attempts"] = sorted([*kept, attempt], key=lambda a: (a["attempt"], a["node_rank"]))


_ATTEMPT_KEYS = ("attempt", "node_rank", "started_ns", "ended_ns", "result", "ranks")
_ATTEMPT_RANK_KEYS = ("rank", "local_rank", "pid", "exit_code", "signal", "first_failure", "time_ns", "error")
_ATTEMPT_RANK_OPTIONAL = ("stderr_tail", "oom_kill")


def _check_attempt(attempt: dict[str, Any]) -> None:
    if set(attempt) != set(_ATTEMPT_KEYS):
        raise ValueError(f"attempt keys must be {list(_ATTEMPT_KEYS)}, got {sorted(attempt)}")
    if attempt["result"] not in ATTEMPT_RESULTS:
        raise ValueError(f"attempt result must be one of {ATTEMPT_RESULTS}, got {attempt['result']!r}")
    for r in attempt["ranks"]:
        if not set(_ATTEMPT_RANK_KEYS) <= set(r) <= set(_ATTEMPT_RANK_KEYS + _ATTEMPT_RANK_OPTIONAL):
            raise ValueError(f"attempt rank keys must be {list(_ATTEMPT_RANK_KEYS)} (and optionally "
                             f"{list(_ATTEMPT_RANK_OPTIONAL)}), got {sorted(r)}")
        if r["error"] is not None and set(r["error"]) != {"type", "message", "traceback"}:
            raise ValueError(f"a rank's error must have keys type, message, traceback; got {sorted(r['error'])}")


def write_rank_info(run_dir: str | os.PathLike, rank: int, *, host: str, node_rank: int, local_rank: int,
                    device: str, pid: int, clock_offset_ns: int, restart: int = 0,
                    device_name: str | None = None) -> None:
    """Write ``<run_dir>/ranks/rankNNNNN.json`` atomically (call it before the rank's first event row);
    ``device_name`` is the GPU model (``torch.cuda.get_device_name``), left out on CPU."""
    path = Path(run_dir) / RANK_INFO_FILE.format(rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(path, {
        "rank": int(rank), "host": str(host), "node_rank": int(node_rank), "local_rank": int(local_rank),
        "device": str(device), "pid": int(pid), "clock_offset_ns": int(clock_offset_ns),
        "restart": int(restart), "time_ns": time.time_ns(),
        **({"device_name": str(device_name)} if device_name else {}),
    })


# ---------------------------------------------------------------------------------------------------- reading


def read_manifest(run_dir: str | os.PathLike) -> Manifest:
    """Read and validate run.json and every ranks/*.json; TraceError if the directory is not a usable run."""
    run_dir = Path(run_dir)
    data = read_run_json(run_dir)
    ranks = tuple(sorted(_rank_infos(run_dir), key=lambda r: r.rank))
    restarts = tuple(
        Restart(restart=int(r["restart"]), time_ns=int(r["time_ns"]), steps_lost=r.get("steps_lost"),
                from_step=r.get("from_step"))
        for r in data.get("restarts") or [])
    return Manifest(
        path=run_dir,
        schema_version=int(data["schema_version"]),
        run_id=str(data["run_id"]),
        status=str(data["status"]),
        world_size=int(data["world_size"]),
        nnodes=int(data.get("nnodes") or 1),
        command=list(data.get("command") or []),
        config=dict(data.get("config") or {}),
        created_ns=data.get("created_ns"),
        ended_ns=data.get("ended_ns"),
        restarts=restarts,
        attempts=tuple(_read_attempts(data.get("attempts"), run_dir / MANIFEST_FILE)),
        ranks=ranks,
        nodes=tuple(sorted({(r.node_rank, r.host) for r in ranks})),
        extra={k: v for k, v in data.items() if k not in _KNOWN_MANIFEST_KEYS},
    )


def _read_attempts(raw: Any, path: Path) -> list[dict[str, Any]]:
    """run.json's ``attempts`` (absent in older runs: empty); TraceError if present but not a list of objects."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(a, dict) and isinstance(a.get("ranks"), list) for a in raw):
        raise TraceError(f"'{path}': \"attempts\" must be a list of objects with a \"ranks\" list (written by "
                         f"the launcher); fix or delete that key.")
    return sorted(raw, key=lambda a: (a.get("attempt", 0), a.get("node_rank", 0)))


def read_run_json(run_dir: Path) -> dict[str, Any]:
    """The validated run.json of ``run_dir`` as a dict (TraceError on a missing, foreign or newer file)."""
    path = run_dir / MANIFEST_FILE
    hint = ("Point at a directory made by `dtprobe run` or `dtprobe.attach`, or use a Kineto trace folder "
            "with `dtprobe analyze`.")
    if not run_dir.is_dir():
        what = "it is a file, not a directory" if run_dir.exists() else "no such directory"
        raise TraceError(f"'{run_dir}' is not a dtprobe run: {what}. {hint}")
    if not path.is_file():
        raise TraceError(f"'{run_dir}' is not a dtprobe run: no {MANIFEST_FILE} in it. {hint}")
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, OSError) as exc:
        raise TraceError(f"'{path}' is not a dtprobe run manifest: it is not readable JSON ({exc}). {hint}") from None
    if not isinstance(data, dict):
        raise TraceError(f"'{path}' is not a dtprobe run manifest: it holds a JSON {type(data).__name__}, "
                         f"not an object. {hint}")
    missing = [k for k in REQUIRED_MANIFEST_KEYS if k not in data]
    if missing or data.get("format") != RUN_FORMAT:
        what = f"it lacks the keys {missing}" if missing else f"its format is {data.get('format')!r}"
        raise TraceError(f"'{run_dir}' is not a dtprobe run: {path.name} is not ours ({what}; expected "
                         f"format {RUN_FORMAT!r}). {hint}")
    check_schema_version(data["schema_version"], path)
    if data["status"] not in RUN_STATUSES:
        raise TraceError(f"'{path}': status is {data['status']!r}, expected one of {list(RUN_STATUSES)}. "
                         f"Fix the \"status\" key (e.g. set it to \"crashed\").")
    return data


def check_schema_version(version: Any, path: Path) -> None:
    """TraceError unless ``version`` (read from ``path``) is one this dtprobe reads (``OLDEST_SCHEMA_VERSION`` up to
    ``SCHEMA_VERSION``)."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceError(f"'{path}': schema_version is {version!r}, expected an integer "
                         f"(this dtprobe writes {SCHEMA_VERSION}). The file is damaged or not ours.")
    if version > SCHEMA_VERSION:
        raise TraceError(f"'{path}' has store schema_version {version}, but this dtprobe reads only up to "
                         f"{SCHEMA_VERSION}. Upgrade dtprobe (pip install -U dtprobe) to read this run.")
    if version < OLDEST_SCHEMA_VERSION:
        raise TraceError(f"'{path}' has store schema_version {version}, older than this dtprobe's oldest "
                         f"readable version {OLDEST_SCHEMA_VERSION}, and no migration exists. Read it with the "
                         f"dtprobe version that wrote it, or re-collect the run.")


RANK_INFO_DIRS_KEPT = 64
"""Runs whose parsed rank infos ``read_manifest`` keeps (least recently read dropped first)."""
_RANK_INFOS: "OrderedDict[str, dict[str, tuple[tuple[int, ...], RankInfo]]]" = OrderedDict()
"""ranks folder -> file name -> (its ``_file_key`` when parsed, the parsed ``RankInfo``)."""
_RANK_INFOS_LOCK = threading.Lock()


def _rank_infos(run_dir: Path) -> list[RankInfo]:
    """Every ``ranks/rankNNNNN.json`` of the run, parsed; a file whose ``_file_key`` is unchanged since this process
    last parsed it is not read again (a live refresh of a 1,024-rank run lists the folder instead of parsing 1,024
    files). A rank rewrites its file by a rename, so a rewritten file has another inode and times."""
    ranks_dir = run_dir / Path(RANK_INFO_FILE).parent
    if not ranks_dir.is_dir():
        return []
    with os.scandir(ranks_dir) as it:
        found = {e.name: _file_key(e.stat()) for e in it
                 if e.name.startswith("rank") and e.name.endswith(".json") and e.name[4:-5].isdigit()}
    folder = str(ranks_dir.resolve())
    with _RANK_INFOS_LOCK:
        known = _RANK_INFOS.get(folder, {})
    parsed = {}
    for name in sorted(found):
        hit = known.get(name)
        parsed[name] = hit if hit is not None and hit[0] == found[name] else (found[name],
                                                                              _read_rank_info(ranks_dir / name))
    with _RANK_INFOS_LOCK:
        _RANK_INFOS[folder] = parsed
        _RANK_INFOS.move_to_end(folder)
        while len(_RANK_INFOS) > RANK_INFO_DIRS_KEPT:
            _RANK_INFOS.popitem(last=False)
    return [info for _, info in parsed.values()]


def _file_key(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten (in place or by a rename)."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_rank_info(path: Path) -> RankInfo:
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, OSError) as exc:
        raise TraceError(f"'{path}' is not readable JSON ({exc}). It is written atomically by the rank at "
                         f"attach; delete it and re-run, or restore it from the run's host.") from None
    missing = [k for k in REQUIRED_RANK_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise TraceError(f"'{path}' lacks the keys {missing}; it was not written by "
                         f"dtprobe.store.manifest.write_rank_info. Rewrite it with that function.")
    expected = int(path.name[4:-5])
    if int(data["rank"]) != expected:
        raise TraceError(f"'{path}' says rank {data['rank']} but its name says rank {expected}; "
                         f"rename the file or fix its \"rank\" key.")
    return RankInfo(rank=int(data["rank"]), host=str(data["host"]), node_rank=int(data["node_rank"]),
                    local_rank=int(data["local_rank"]), device=str(data["device"]), pid=int(data["pid"]),
                    clock_offset_ns=int(data["clock_offset_ns"]), restart=int(data.get("restart") or 0),
                    device_name=str(data["device_name"]) if data.get("device_name") else None)


# ---------------------------------------------------------------------------------------------------- helpers


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader, or a process killed meanwhile,
    leaves the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def swap_in_dir(new: Path, target: Path, graveyard: Path) -> None:
    """Put the folder ``new`` in place of ``target`` (moved to ``graveyard`` first, then removed): a reader sees
    the old folder or the new one, whole, apart from the instant between the two renames."""
    if target.exists():
        os.rename(target, graveyard)
    os.rename(new, target)
    shutil.rmtree(graveyard, ignore_errors=True)


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the files under ``folder``, one directory scan per folder, symlinks not followed; 0 when it is not
    a folder. A file or folder removed while it is scanned counts 0 (a cache pruned by another process)."""
    try:
        with os.scandir(folder) as scan:
            items = list(scan)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    total = 0
    for item in items:
        try:
            if item.is_dir(follow_symlinks=False):
                total += folder_bytes(item.path)
            elif item.is_file(follow_symlinks=False):
                total += item.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomically(path, json.dumps(data, indent=1) + "\n")


@contextlib.contextmanager
def _locked_manifest(run_dir: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Yield run.json as a dict under an exclusive lock; write it back atomically on normal exit.

    FileNotFoundError if there is no run.json yet (e.g. attach mode before the leader created it); TraceError if
    it is not a valid dtprobe manifest.
    """
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(errno.ENOENT, f"no {MANIFEST_FILE} to update (create_manifest first)", str(path))
    with open(run_dir / ".run.json.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = read_run_json(run_dir)
            yield data
            _write_json_atomic(run_dir / MANIFEST_FILE, data)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
