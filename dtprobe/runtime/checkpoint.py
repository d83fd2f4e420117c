"""DCP checkpoints with an atomic commit; produces the ``checkpoints`` table and checkpoint faults.

Layout under ``<run>/checkpoints/`` (read back by ``Checkpointer.load_latest`` after a restart)::

    .tmp-step00000010/        being written (DCP files of every rank + .metadata); never loaded
    step00000010/             committed: the DCP files plus COMMIT.json
    step00000010/COMMIT.json  {"step", "created_ns", "world_size", "files": {name: {"num_bytes", "crc32"}}}
    LATEST                    "step00000010": pointer to the newest commit, swapped with os.replace

Every rank checksums the data files it wrote as it finishes writing them (``<file>.crc32.json`` beside each,
``write_checksums``), on the thread that wrote them. Commit protocol (the leader, once every rank's data and
DCP's ``.metadata`` are on disk, i.e. after ``dcp.save`` returns or the ``async_save`` future completes): take
those checksums and checksum the rest (``.metadata``), write ``COMMIT.json`` (write aside + ``os.replace``),
remove the checksum files, rename ``.tmp-stepN`` to ``stepN``, swap ``LATEST``, then prune all but the newest
``keep`` commits. A crash or SIGKILL at any point leaves the previous commit intact and loadable.
``step`` is the number of the last completed training step; training resumes at ``step + 1``.

Loading verifies sizes and CRC32s against ``COMMIT.json`` and walks back from the newest commit to the first
that verifies (a truncated file fails the size check, a flipped bit the CRC32: CRC32 catches every single-bit and
every burst error up to 32 bits); each rejected one gives a ``faults`` row ``kind="corrupt-ckpt",
injected=false``, written by the leader (the rank that verifies) with ``step`` = the rejected checkpoint's step and
detail ``{"path": checkpoint dir, "file": name of the file that failed in it, "ckpt_step", "reason",
"fallback_step": step of the checkpoint loaded instead, or null when none verified (training then starts from
step 0)}``.

Rows of ``checkpoints`` (one per save or load and rank): ``kind`` save|load, ``start_ns``, ``blocking_ns`` (the
training thread was blocked: ``dcp.save``, or ``async_save`` up to its return), ``async_ns`` (from that return
until the background write finished; 0 for sync), ``total_ns``, ``num_bytes`` (written or read by this rank;
DCP deduplicates replicated tensors, so DDP ranks write unequal shares; for a load, the checkpoint's data
size), ``ok``, ``path``.

Async saves run on their own gloo process group (``process_group``): on the default group the background
thread's collectives interleave with training collectives and deadlock (FSDP).
Injected faults: ``slow-ckpt`` (rank R's storage writes sleep ``delay_ms``: in the background under async) and
``corrupt-ckpt`` (after committing step S the leader damages a data file).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import orjson
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dtprobe.runtime.config_sections import CheckpointConfig  # noqa: F401 (its config, re-exported)
from dtprobe.store.errors import TraceError
from dtprobe.store.schema import CHECKPOINTS_DIR

COMMIT_FILE = "COMMIT.json"
LATEST_FILE = "LATEST"
_NAME = "step{step:08d}"
_NAME_RE = re.compile(r"^step(\d{8})$")
_TMP_PREFIX = ".tmp-"

Recorder = Callable[[str, dict[str, Any]], None]
FaultRecorder = Callable[..., None]


class CorruptCheckpoint(TraceError):
    """A committed checkpoint fails verification; the message names the file and what does not match, ``file``
    is that file's name inside the checkpoint directory."""

    def __init__(self, message: str, *, file: str) -> None:
        super().__init__(message)
        self.file = file


class TrainState(Stateful):
    """What a checkpoint holds: model and optimizer (DCP state dicts, any layout), step, and extras.

    ``extras`` maps a key to an object with ``state_dict()``/``load_state_dict()`` (e.g. the loss scaler).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: int = -1,
                 extras: dict[str, Any] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.step = step
        self.extras = dict(extras or {})

    # Flattened optimizer state ("optim.state.<fqn>.exp_avg", "optim.param_groups.<fqn>.lr"): every entry is keyed
    # by parameter, so pipeline stages holding different parameters never overwrite each other's param groups
    # (DCP writes a non-tensor key once), and the checkpoint loads into any layout.
    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._OPTIONS)
        return {"model": msd, "optim": osd, "step": self.step,
                **{f"extra.{k}": v.state_dict() for k, v in self.extras.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self._OPTIONS)
        self.step = int(state["step"])
        for k, v in self.extras.items():
            v.load_state_dict(state[f"extra.{k}"])


class _MeasuredWriter(FileSystemWriter):
    """FileSystemWriter that counts this rank's bytes, checksums the files it wrote (``write_checksums``: the
    leader's commit reads them instead of reading every rank's data) and can sleep before writing
    (``slow-ckpt``)."""

    def __init__(self, path: Path, *, delay_s: float = 0.0) -> None:
        super().__init__(str(path))
        self.dir = path
        self.delay_s = delay_s
        self.num_bytes = 0

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        fut = super().write_data(plan, planner)
        results = fut.wait()
        self.num_bytes = sum(int(r.storage_data.length) for r in results)
        write_checksums(self.dir, sorted({r.storage_data.relative_path for r in results}))
        return fut


CHECKSUM_SUFFIX = ".crc32.json"
"""A rank's checksum of a file it wrote, beside it until the commit (``{"num_bytes", "crc32"}``)."""


def write_checksums(path: Path, names: list[str]) -> None:
    """Checksum the files ``names`` of checkpoint dir ``path`` that this rank wrote, each into its
    ``CHECKSUM_SUFFIX`` file (written aside, then renamed: the commit never reads half of one). Every rank
    checksums its own files, as it writes them: the leader's commit would otherwise read the whole checkpoint
    of every rank, a cost that grows with the world size and falls on one rank's training."""
    for name in names:
        f = path / name
        body = orjson.dumps({"num_bytes": f.stat().st_size, "crc32": _crc32(f)})
        tmp = path / (name + CHECKSUM_SUFFIX + ".tmp")
        tmp.write_bytes(body)
        os.replace(tmp, path / (name + CHECKSUM_SUFFIX))


def checkpoint_name(step: int) -> str:
    return _NAME.format(step=step)


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint dirs under ``root`` (those with a COMMIT.json), newest step first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME_RE.match(p.name)
            if m and p.is_dir() and (p / COMMIT_FILE).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_commit(path: Path, *, step: int, world_size: int) -> dict[str, Any]:
    """Checksum every file of ``path`` and write its COMMIT.json atomically; returns the marker. A file whose
    writer left its checksum (``write_checksums``) for its present size takes that one; the others (DCP's
    ``.metadata``, which the coordinator writes last) are read here. The checksum files are removed once the
    marker is written."""
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    sums = {n for n in names if n.endswith(CHECKSUM_SUFFIX)}
    files = {}
    for name in names:
        if name == COMMIT_FILE or name.endswith(CHECKSUM_SUFFIX) or name.endswith(".tmp"):
            continue
        size = (path / name).stat().st_size
        given = _read_checksum(path / (name + CHECKSUM_SUFFIX)) if name + CHECKSUM_SUFFIX in sums else None
        crc = given["crc32"] if given is not None and given["num_bytes"] == size else _crc32(path / name)
        files[name] = {"num_bytes": size, "crc32": crc}
    marker = {"step": step, "created_ns": time.time_ns(), "world_size": world_size, "files": files}
    tmp = path / (COMMIT_FILE + ".tmp")
    tmp.write_bytes(orjson.dumps(marker, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path / COMMIT_FILE)
    for name in sums:
        (path / name).unlink(missing_ok=True)
    return marker


def _read_checksum(path: Path) -> dict[str, int] | None:
    """A ``write_checksums`` file's figures, or None when it cannot be read (the commit then reads the file)."""
    try:
        data = orjson.loads(path.read_bytes())
        return {"num_bytes": int(data["num_bytes"]), "crc32": int(data["crc32"])}
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The COMMIT.json of ``path`` once every listed file matches its size and CRC32; else CorruptCheckpoint."""
    marker_path = path / COMMIT_FILE
    try:
        marker = orjson.loads(marker_path.read_bytes())
        files = marker["files"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{marker_path}: unreadable commit marker ({e}); this checkpoint is skipped.",
                                file=COMMIT_FILE) from None
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CorruptCheckpoint(f"{marker_path}: lists no DCP .metadata file; the save did not finish.",
                                file=".metadata")
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CorruptCheckpoint(f"{f}: listed in {COMMIT_FILE} but missing.", file=name)
        try:
            size, crc = f.stat().st_size, _crc32(f)
            want_size, want_crc = int(want["num_bytes"]), int(want["crc32"])
        except OSError as e:
            raise CorruptCheckpoint(f"{f}: unreadable ({e}).", file=name) from None
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"{marker_path}: bad entry for {name}: {want!r}.", file=COMMIT_FILE) from None
        if size != want_size:
            raise CorruptCheckpoint(f"{f}: {size} bytes, {COMMIT_FILE} says {want_size} (truncated?).", file=name)
        if crc != want_crc:
            raise CorruptCheckpoint(f"{f}: CRC32 {crc:#010x} != {want_crc:#010x} in {COMMIT_FILE} "
                                    f"(damaged after commit).", file=name)
    return marker


def corrupt_checkpoint(path: Path) -> str:
    """Damage ``path`` after commit (the ``corrupt-ckpt`` fault): flip bytes in its largest data file."""
    data = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(data.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return data.name


class Checkpointer:
    """Saves every ``config.every`` steps, commits atomically, loads the newest verified checkpoint.

    Call ``maybe_save(state, step=)`` after each completed step and ``close()`` at the end (waits for an async
    save). ``record`` is ``probe.record``; ``fault`` is ``probe.fault``. ``process_group`` carries DCP's
    collectives (for async saves, a group of its own, e.g. ``probe.new_group(ranks, name="ckpt")``); None uses
    the default group for sync saves and creates a gloo group for async saves.
    """

    def __init__(self, config: CheckpointConfig, run_dir: str | os.PathLike, *, rank: int, world_size: int,
                 is_leader: bool, process_group: Any = None, record: Recorder | None = None,
                 fault: FaultRecorder | None = None, slow_delay_ms: int = 0,
                 corrupt_steps: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.rank = rank
        self.world_size = world_size
        self.is_leader = is_leader
        self._record = record or (lambda table, row: None)
        self._fault = fault or (lambda kind, **kw: None)
        self.slow_delay_ms = slow_delay_ms
        self.corrupt_steps = corrupt_steps
        if process_group is None and config.async_save and dist.is_initialized():
            process_group = dist.new_group(backend="gloo")
        self.process_group = process_group
        self._pending: tuple[Future, threading.Event] | None = None
        if is_leader:
            self.root.mkdir(parents=True, exist_ok=True)
            for p in self.root.glob(_TMP_PREFIX + "*"):      # unfinished saves of a crashed attempt
                shutil.rmtree(p, ignore_errors=True)

    # ---- save
    def should_save(self, step: int, *, first_step: int = 0) -> bool:
        return self.config.enabled and (step - first_step + 1) % self.config.every == 0

    def maybe_save(self, state: TrainState, *, step: int, first_step: int = 0) -> bool:
        """Save after step ``step`` when it is a multiple of ``every`` (counting from ``first_step``)."""
        if not self.should_save(step, first_step=first_step):
            return False
        self.save(state, step=step)
        return True

    def save(self, state: TrainState, *, step: int) -> None:
        """Write a checkpoint of ``state`` at ``step``: blocking, or in the background under async."""
        self.wait()                                          # one save in flight at a time
        state.step = step
        tmp = self.root / (_TMP_PREFIX + checkpoint_name(step))
        tmp.mkdir(parents=True, exist_ok=True)              # every rank: DCP writes rank files here
        delay = self.slow_delay_ms / 1000.0
        writer = _MeasuredWriter(tmp, delay_s=delay)
        if delay:
            self._fault("slow-ckpt", step=step, injected=True, delay_ms=self.slow_delay_ms)
        start_ns = time.time_ns()
        t0 = time.perf_counter_ns()
        if self.config.async_save:
            fut = dcp.async_save({"app": state}, storage_writer=writer, process_group=self.process_group)
            blocking = time.perf_counter_ns() - t0
            finished = threading.Event()
            self._pending = (fut, finished)
            fut.add_done_callback(lambda f: self._finish(f, step=step, tmp=tmp, writer=writer, start_ns=start_ns,
                                                         t0=t0, blocking=blocking, finished=finished))
        else:
            dcp.save({"app": state}, storage_writer=writer, process_group=self.process_group)
            self._commit(step, tmp)
            total = time.perf_counter_ns() - t0
            self._record("checkpoints", {
                "step": step, "kind": "save", "start_ns": start_ns, "blocking_ns": total, "async_ns": 0,
                "total_ns": total, "num_bytes": writer.num_bytes, "ok": True,
                "path": str(self.root / checkpoint_name(step))})

    def _finish(self, fut: Future, *, step: int, tmp: Path, writer: _MeasuredWriter, start_ns: int, t0: int,
                blocking: int, finished: threading.Event) -> None:
        # Runs on DCP's background thread when the async save ends; ``wait`` blocks on ``finished``.
        try:
            total = time.perf_counter_ns() - t0
            ok = fut.exception() is None
            if ok:
                try:
                    self._commit(step, tmp)
                except OSError as e:
                    ok = False
                    self._fault("ckpt-commit-failed", step=step, injected=False, path=str(tmp), reason=str(e))
            self._record("checkpoints", {
                "step": step, "kind": "save", "start_ns": start_ns, "blocking_ns": blocking,
                "async_ns": total - blocking, "total_ns": total, "num_bytes": writer.num_bytes, "ok": ok,
                "path": str(self.root / checkpoint_name(step))})
        finally:
            finished.set()

    def _commit(self, step: int, tmp: Path) -> None:
        if not self.is_leader:
            return
        final = self.root / checkpoint_name(step)
        write_commit(tmp, step=step, world_size=self.world_size)
        if final.exists():                                  # re-saving a step after a restart
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest_tmp = self.root / (LATEST_FILE + ".tmp")
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, self.root / LATEST_FILE)
        if step in self.corrupt_steps:
            damaged = corrupt_checkpoint(final)
            self._fault("corrupt-ckpt", step=step, injected=True, path=str(final), file=damaged)
        self._prune()

    def _prune(self) -> None:
        if self.config.keep:
            for _, old in committed_checkpoints(self.root)[self.config.keep:]:
                shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Block until an in-flight async save has finished (and been committed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            fut, finished = pending
            fut.result()                                    # raises if the background save failed
            finished.wait()                                 # ... and the commit (done-callback) has run

    def close(self) -> None:
        self.wait()

    # ---- load
    def newest_verified(self) -> Path | None:
        """Leader only: the newest committed checkpoint whose files verify; a ``corrupt-ckpt`` fault for each newer
        one rejected, naming the step loaded instead (null: none, training starts from step 0)."""
        rejected: list[tuple[int, Path, CorruptCheckpoint]] = []
        chosen: tuple[int, Path] | None = None
        for step, path in committed_checkpoints(self.root):
            try:
                verify_checkpoint(path)
            except CorruptCheckpoint as e:
                rejected.append((step, path, e))
                continue
            chosen = (step, path)
            break
        fallback = None if chosen is None else chosen[0]
        for step, path, e in rejected:
            self._fault("corrupt-ckpt", step=step, injected=False, path=str(path), file=e.file, ckpt_step=step,
                        reason=str(e), fallback_step=fallback)
        if rejected:
            instead = (f"loading step {fallback}" if chosen else
                       "no usable checkpoint remains: training starts from step 0")
            print(f"[dtprobe] rank {self.rank}: rejected checkpoint(s) of step "
                  f"{', '.join(str(s) for s, _, _ in rejected)} (failed verification); {instead}.", file=sys.stderr,
                  flush=True)
        return None if chosen is None else chosen[1]

    def load_latest(self, state: TrainState) -> int | None:
        """Load the newest verified checkpoint into ``state`` on every rank; its step, or None if none.

        Collective: the leader verifies and broadcasts the choice on the default group, then all ranks load.
        """
        choice = [str(self.newest_verified() or "") if self.is_leader else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        if not choice[0]:
            return None
        path = Path(choice[0])
        start_ns = time.time_ns()
        t0 = time.perf_counter_ns()
        dcp.load({"app": state}, checkpoint_id=str(path), process_group=None)
        total = time.perf_counter_ns() - t0
        num_bytes = sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".distcp")
        self._record("checkpoints", {
            "step": state.step, "kind": "load", "start_ns": start_ns, "blocking_ns": total, "async_ns": 0,
            "total_ns": total, "num_bytes": num_bytes, "ok": True, "path": str(path)})
        return state.step
