"""``dtprobe.attach``: instrument a torchrun worker and return the ``Probe`` (steps, collectives, devices, traces).

Launch example (a user script)::

    torchrun --standalone --nproc-per-node 2 train.py      # train.py calls dtprobe.attach("runs/my-run")

    probe = dtprobe.attach("runs/my-run", profile_steps=(10, 11), device_interval_s=1.0)
    with probe.step(step) as s:
        with s.phase("fwd"): loss = model(batch)
        ...
        s.record(loss=loss.item(), tokens=n, lr=lr)
    probe.close()

Attach before or after ``init_process_group``, one way: before it, ``attach`` initializes torch.distributed on the
plain backend (``"gloo"``, or ``"nccl"`` with CUDA) and then does what it does after it
(``_record_initialized_groups``): the default group is wrapped in place, and groups created later on gloo or NCCL
are created on the recording backends ``dtprobe_gloo``/``dtprobe_nccl`` under the backend name they were asked for
(groups created before attach are named in a warning). So ``dist.get_backend()`` and ``dist.get_backend(group)`` answer "gloo"/"nccl" as without
dtprobe (Lightning, Accelerate and DeepSpeed branch on it), while every group's collectives are recorded. A script
that names ``dtprobe_gloo``/``dtprobe_nccl`` in its own ``init_process_group`` keeps them (and that name).

Groups: the default group is ``pg="world"``; a DeviceMesh axis group is recorded under its axis name;
``probe.new_group(ranks, name="ckpt")`` names a subgroup; ``probe.init_device_mesh(..., mesh_dim_names=("dp",
"tp"))`` (or ``probe.name_mesh(mesh)`` for a mesh built elsewhere) names each axis group after its axis. An axis
spanning all ranks reuses the default group, which is then recorded under that axis name.

One probe per process: a second ``attach`` (a framework callback under ``dtprobe launch``, or after the script's
own ``attach``) returns the open probe (``open_probe``) instead of starting a second recorder.

Written: ``ranks/rankNNNNN.json`` (every rank), ``run.json`` (attach-mode leader, when absent), ``events/*``
(steps, collectives, pending, lifecycle, devices, faults, anything given to ``probe.record``),
``traces/steps<a>-<b>/``.

Loss bound: rows reach the OS every ``flush_interval_s`` (0.1 s) from background threads, so a killed rank
loses at most its last 0.1 s of rows, and a collective it waited in for more than 0.2 s is on disk (``pending``).
``lifecycle`` gets an "attach" row at attach and a "close" row at close (``probe.close``, the ``with`` block, the
interpreter's exit, or SIGTERM, see ``dtprobe.collectors.sigterm``): a rank with no close row was killed or frozen.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Sequence

import orjson
import torch
import torch.distributed as dist

from dtprobe.collectors import nccl, sigterm, torch_internals, training
from dtprobe.collectors.clock import RESYNC_TIMEOUT_S, ClockResync, measure_clock_sample, start_clock_resync
from dtprobe.collectors.collective_recorder import RECORDER
from dtprobe.collectors.config import CollectConfig
from dtprobe.collectors.cuda_clock import clock_for
from dtprobe.collectors.devices import DeviceSampler
from dtprobe.collectors.kernels import ProfilerWindow
from dtprobe.collectors.null import NullProbe
from dtprobe.collectors.pg_wrapper import GLOO_BACKEND, NCCL_BACKEND, RecordingProcessGroup, register_backends
from dtprobe.collectors.training import StepContext
from dtprobe.store import manifest as store_manifest
from dtprobe.store.errors import ConfigError
from dtprobe.store.schema import MANIFEST_FILE, SCHEMAS
from dtprobe.store.writer import RankWriter

_CONFIG_FIELDS = frozenset(f.name for f in fields(CollectConfig))


def _restart_store(timeout: datetime.timedelta) -> Any:
    """After a torchrun restart, the agent's store with a per-attempt key prefix; None otherwise.

    torchrun's agent shares one TCPStore server across restart rounds (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``
    unset), so a restarted worker can read the previous attempt's gloo addresses under the same keys and fail
    with "Gloo connectFullMesh failed ... Connection refused" when its peer has not re-published yet.
    """
    restart = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _env_int("WORLD_SIZE", 1),
                        is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dtprobe/attempt{restart}", tcp)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class Probe:
    """The handle a worker records through; built by ``attach``. See the module docstring for the flow.

    Attributes: ``rank``, ``world_size``, ``local_rank``, ``node_rank``, ``restart``, ``is_leader``, ``run_dir``,
    ``writer`` (``RankWriter``), ``device`` (``"cpu"`` or ``"cuda:N"``), ``config``, ``clock_offset_ns``.
    """

    def __init__(self, run_dir: Path, config: CollectConfig, *, rank: int, world_size: int, local_rank: int,
                 node_rank: int, restart: int, device: str, manage_status: bool) -> None:
        self.run_dir = run_dir
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.node_rank = node_rank
        self.restart = restart
        self.device = device
        self.manage_status = manage_status
        """True in attach mode: the leader sets the run status at close; under ``dtprobe run`` the launcher does."""
        self.writer = RankWriter(run_dir, rank, flush_interval_s=config.flush_interval_s, autoflush=True)
        self.clock_offset_ns = 0
        self.clock_rtt_ns = 0
        self._step = -1
        self.owns_process_group = False
        """True when ``attach`` initialized torch.distributed (then an NCCL group is destroyed at exit)."""
        self.step_hooks: Any = None
        """What writes this probe's steps from torch's hooks (``dtprobe launch``: ``launch_steps.ScriptSteps``),
        else None. A framework callback that reuses the probe marks its own steps instead: it calls
        ``stop_step_hooks()`` so each step is written once; a second ``attach`` stops them at its first ``step``."""
        self._caller_marks_steps = False
        """Set when a second ``attach`` reused this probe: its first ``step()`` stops ``step_hooks``."""
        self._sampler: DeviceSampler | None = None
        self._profiler: ProfilerWindow | None = None
        self._clock: ClockResync | None = None
        self._closed = False
        self._close_lock = threading.RLock()     # SIGTERM closes from another thread: a second caller waits

    # ---- roles ----
    @property
    def is_leader(self) -> bool:
        """Rank 0: writes the manifest in attach mode and sets its status."""
        return self.rank == 0

    @property
    def current_step(self) -> int:
        """The step whose ``probe.step`` context is open, else -1."""
        return self._step

    # ---- training events ----
    def step(self, step: int) -> StepContext:
        """``with probe.step(n) as s:`` times step ``n``, marks collectives with it, writes its ``steps`` row."""
        if self._caller_marks_steps:
            self.stop_step_hooks()     # a reusing caller marks its first step: the hook-driven steps stop now
        return StepContext(int(step), on_enter=self._on_step_enter, on_exit=self._on_step_exit)

    def stop_step_hooks(self) -> None:
        """Stop ``step_hooks`` (``dtprobe launch``'s hook-driven steps) for good: whoever reuses this probe marks
        the steps from now on, so each step is written once. No-op without them."""
        hooks, self.step_hooks = self.step_hooks, None
        if hooks is not None:
            hooks.close()

    def hook_step(self, step: int) -> StepContext:
        """``step`` for ``step_hooks`` (the steps ``dtprobe launch`` finds from torch's hooks)."""
        return StepContext(int(step), on_enter=self._on_step_enter, on_exit=self._on_step_exit)

    def _on_step_enter(self, step: int) -> None:
        self._step = step
        RECORDER.step = step
        if self._profiler is not None:
            self._profiler.on_step_begin(step)

    def _on_step_exit(self, ctx: StepContext) -> None:
        self.writer.write("steps", ctx.row(restart=self.restart))
        if self._profiler is not None:
            self._profiler.on_step_end(ctx.step)
        self._step = -1
        RECORDER.step = -1
        RECORDER.step_ended(ctx.step)

    def discard_step(self, ctx: StepContext) -> None:
        """Leave the open step ``ctx`` without writing its row (``dtprobe launch``: a step that ended with no
        optimizer step, e.g. evaluation after the last one)."""
        if self._step == ctx.step:
            self._step = -1
            RECORDER.step = -1
            RECORDER.step_ended(ctx.step)

    def fault(self, kind: str, *, step: Any = None, injected: bool = False, **detail: Any) -> None:
        """Write a ``faults`` row; ``step`` (an int or the step context) defaults to the current step;
        ``detail`` keywords are stored as a JSON object (e.g. ``delay_ms=40``)."""
        self.writer.write("faults", {
            "time_ns": time.time_ns(), "step": self._step if step is None else int(step), "kind": str(kind),
            "injected": bool(injected), "detail": orjson.dumps(detail, default=str).decode(),
        })

    def record(self, table: str, row: dict[str, Any]) -> None:
        """Write a row of any schema table (amp, checkpoints, pipeline, memory, ...); ``step`` defaults to the
        current step and ``restart`` to this attempt's when the table has that column."""
        if table not in SCHEMAS:
            raise ConfigError(f"probe.record: unknown table {table!r}; tables are {sorted(SCHEMAS)} "
                              f"(dtprobe/store/schema.py).")
        unknown = set(row) - set(SCHEMAS[table])
        if unknown:
            raise ConfigError(f"probe.record({table!r}): unknown columns {sorted(unknown)}; the table has "
                              f"{sorted(SCHEMAS[table])}.")
        if "step" in SCHEMAS[table] and "step" not in row:
            row = {**row, "step": self._step}
        if "restart" in SCHEMAS[table] and "restart" not in row:
            row = {**row, "restart": self.restart}
        self.writer.write(table, row)

    # ---- groups ----
    def new_group(self, ranks: Sequence[int] | None = None, *, name: str, timeout_s: float | None = None,
                  **kwargs: Any) -> dist.ProcessGroup:
        """``dist.new_group(ranks)``, recorded as ``pg=name`` (e.g. "dp", "ckpt"); on the default group's backend
        unless ``backend=`` says otherwise, recorded when that backend is gloo or NCCL (see the module docstring).

        Collective over all ranks (like ``dist.new_group``). ``kwargs`` go to ``dist.new_group``.
        """
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        group = dist.new_group(list(ranks) if ranks is not None else None, **kwargs)
        self.name_group(group, name)
        return group

    def name_group(self, group: Any, name: str) -> None:
        """Record ``group``'s collectives as ``pg=name`` (no effect on non-recording groups / non-members)."""
        if isinstance(group, RecordingProcessGroup):
            group.dtprobe_name = name

    def init_device_mesh(self, device_type: str, mesh_shape: Sequence[int], *,
                         mesh_dim_names: Sequence[str]) -> Any:
        """``torch.distributed.device_mesh.init_device_mesh`` whose per-axis groups record ``pg=<axis name>``.

        The mesh creates its axis groups with ``new_group`` on the default group's backend (gloo or NCCL: recording
        groups, see the module docstring), and ``name_mesh`` labels each with its axis. A 1-D mesh over all ranks
        reuses the default group, which is then recorded under the axis name too (e.g. "dp" instead of "world")."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))
        self.name_mesh(mesh)
        return mesh

    def name_mesh(self, mesh: Any) -> None:
        """Label the recording groups of every named axis of ``mesh`` (also for meshes built elsewhere, and
        flattened axes such as ``mesh["dp", "tp"]._flatten("dp_tp")`` once flattened)."""
        names = getattr(mesh, "mesh_dim_names", None) or ()
        for name in names:
            self.name_group(mesh.get_group(name), name)

    def pending_collectives(self) -> list[dict[str, Any]]:
        """Rows of this rank's collectives issued but not completed (what a hung rank waits on)."""
        return RECORDER.pending()

    # ---- lifecycle ----
    def flush(self, *, in_flight: bool = False) -> None:
        """Write buffered rows to disk now; ``in_flight``: also the collectives not completed yet (end null, as
        at close), e.g. when the hang watchdog gives up on them: they are the evidence of who never arrived."""
        if RECORDER.writer is self.writer:
            if in_flight:
                RECORDER.flush_in_flight()
            RECORDER.drain()
        self.writer.flush()

    def close(self, status: str = "finished", *, reason: str | None = None) -> None:
        """Write in-flight collectives (end null) and the ``lifecycle`` close row, stop the profiler (exporting
        its trace) and the sampler, flush and close the files; in attach mode the leader sets the run status.

        ``status``: "finished" or "crashed". ``reason``: why it closes, stored in the close row: "exit",
        "exception", "SIGTERM", "watchdog" (default: "exit" when finished, else "exception"). Idempotent and
        thread-safe: a second caller returns once the first one's close is done.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if reason is None:
                reason = "exit" if status == "finished" else "exception"
            global _OPEN_PROBE
            if _OPEN_PROBE is self:
                _OPEN_PROBE = None
            try:
                if self._clock is not None:         # first: no clock row after the close row
                    self._clock.stop()
                # In-flight collectives and the close row first, flushed at once: a rank killed while it closes
                # (torchrun stops the others when one exits) keeps them; the profiler's export and the
                # sampler's join are slow.
                if RECORDER.writer is self.writer:
                    RECORDER.stop()
                self._lifecycle("close", status=status, reason=reason, step=self._step)
                self.writer.flush()
                if self._profiler is not None:
                    self._profiler.stop()
                if self._sampler is not None:
                    self._sampler.close()
            finally:
                self.writer.close()
                if self.manage_status and self.is_leader:
                    store_manifest.set_status(self.run_dir, status)

    def _lifecycle(self, event: str, **row: Any) -> None:
        self.writer.write("lifecycle", {"restart": self.restart, "time_ns": time.time_ns(), "event": event,
                                        "pid": os.getpid(), **row})

    def _close_at_exit(self) -> None:
        self.close(status="crashed" if getattr(sys, "last_value", None) is not None else "finished")
        # Before the interpreter finalizes: no gloo thread may still need the GIL for our done-callbacks
        RECORDER.settle_callbacks()
        # The NCCL completion hook runs Python on the watchdog thread: its group must go before the interpreter.
        if self.owns_process_group and self.device.startswith("cuda") and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(status="crashed" if exc_type is not None else "finished")


_OPEN_PROBE: Probe | None = None
"""The probe ``attach`` returned in this process and not closed yet (``open_probe``)."""


def open_probe() -> Probe | None:
    """The probe attached in this process and not yet closed, else None: what a second ``attach`` returns.

    A framework callback asks this before attaching: a probe it finds was opened by someone else (``dtprobe
    launch``'s worker, the script's own ``dtprobe.attach``), who also closes it."""
    return _OPEN_PROBE


def _record_initialized_groups(*, nccl_timing: bool) -> None:
    """Record the default group from now on, and the groups created later: what ``attach`` does after the script's
    ``init_process_group`` and after its own.

    A gloo or NCCL default group gets a recording group around it, registered in its place
    (``torch_internals.replace_default_group``): calls without ``group=`` (DDP, FSDP2, a DeviceMesh axis over all
    ranks) are recorded; groups created later on gloo or nccl (``new_group``, DeviceMesh axes) are made on
    ``dtprobe_gloo``/``dtprobe_nccl`` (``torch_internals.record_new_groups``). Every group keeps the backend name
    it was asked for, so ``dist.get_backend()`` still says "gloo" or "nccl". Groups created before (and objects
    holding the old default group, e.g. a DDP built before) are not recorded: one warning names them with the fix.
    A default group already on ``dtprobe_gloo``/``dtprobe_nccl`` (the script named it) is recorded as it is.
    Other default backends (a mixed ``"cpu:gloo,cuda:nccl"``, MPI) are left alone, with a warning. An NCCL default
    group bound to a device (``device_id``) is recorded too: the recording groups made for later groups are split
    from its communicator as torch's own would be (``torch_internals.split_from_bound_default``), and a split of
    the recording group (``dist.split_group``, a DeviceMesh) is a recording group (``RecordingProcessGroup
    .split_group``).
    """
    fix = ("Call dtprobe.attach() right after init_process_group and before creating them (DDP, FSDP2, "
           "DeviceMesh, new_group), or run the script unchanged with `dtprobe launch`.")
    old = torch_internals.default_group()
    if not isinstance(old, RecordingProcessGroup):
        backends = set(torch_internals.group_device_backends(old).values())
        if backends not in ({"gloo"}, {"nccl"}):
            warnings.warn(
                f"dtprobe.attach: the default process group is on {sorted(backends)}, which dtprobe cannot record "
                f"(one backend for every device, gloo or nccl, only), so its collectives are NOT recorded. "
                f"Initialize with backend=\"gloo\" or \"nccl\" (or let dtprobe.attach initialize).", stacklevel=3)
            return
        on_nccl = backends == {"nccl"}
        wrapper = RecordingProcessGroup(old, old.rank(), old.size(), backend_name=NCCL_BACKEND if on_nccl
                                        else GLOO_BACKEND, device_timing=on_nccl)
        if on_nccl:
            nccl.time_rows(wrapper, RECORDER, device_timing=nccl_timing)
        torch_internals.replace_default_group(wrapper)
        torch_internals.record_new_groups(_recording_backend)
    unrecorded = [(name, desc, ranks) for pg, name, desc, ranks in torch_internals.registered_groups()
                  if pg is not old and not isinstance(pg, RecordingProcessGroup)]
    if unrecorded:
        listed = ", ".join(f"{name!r} ({desc or 'no description'}, ranks {ranks})" for name, desc, ranks in unrecorded)
        warnings.warn(f"dtprobe.attach: {len(unrecorded)} process group(s) created before attach are NOT recorded: "
                      f"{listed}. {fix}", stacklevel=3)


def _recording_backend(name: str) -> str | None:
    """The recording backend of groups asked for on ``name`` after attach: ``dtprobe_gloo`` when every device of
    ``name`` runs gloo (``"gloo"``, ``"cpu:gloo"``, ``"undefined"`` on a CPU build), ``dtprobe_nccl`` when every
    one runs NCCL; None for the others (mixed, MPI, plugins, dtprobe's own), which are created as asked."""
    backends = set(torch_internals.backend_devices(name).values())
    return {frozenset({"gloo"}): GLOO_BACKEND, frozenset({"nccl"}): NCCL_BACKEND}.get(frozenset(backends))


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _reuse_open_probe(existing: Probe, run_dir: Path, config: CollectConfig) -> Probe:
    """What a second ``attach`` returns: the open probe, whose steps become the caller's once it marks one
    (``dtprobe launch``'s hook-driven steps stop at its first ``probe.step``, so each step is written once, and a
    caller that marks none keeps them); a warning when the caller asked for another run directory or other
    options."""
    if existing.run_dir.resolve() != run_dir.resolve() or existing.config != config:
        warnings.warn(
            f"dtprobe.attach: this process already records into {existing.run_dir} (attached earlier by `dtprobe "
            f"launch`, the script or a callback); returning that probe, so rows go there and not to {run_dir}, "
            f"with its options {existing.config}. Attach once per process.", stacklevel=3)
    existing._caller_marks_steps = True
    return existing


def _init_process_group(backend: str, *, timeout_s: float, local_rank: int) -> None:
    """``init_process_group(backend)`` from the torchrun environment (``env://``, or the per-attempt store after a
    restart), or a 1-rank group on a ``HashStore`` without one (a plain ``python train.py``).

    On NCCL the group is bound to this rank's GPU (``device_id``, also made the current device): torch connects the
    communicator at once and splits later groups from it instead of guessing the device at the first collective.
    """
    bound: dict[str, Any] = {}
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
        bound["device_id"] = torch.device("cuda", local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ or "MASTER_ADDR" in os.environ:
        store = _restart_store(timeout)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=_env_int("RANK", 0),
                                    world_size=_env_int("WORLD_SIZE", 1), timeout=timeout, **bound)
        else:
            dist.init_process_group(backend, timeout=timeout, **bound)
    else:   # a plain `python train.py`: a 1-rank job
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bound)
        # Left to the interpreter's exit, gloo's threads were once torn down mid-flight (the C++ runtime's
        # "terminate called without an active exception", exit -6) in a CI run; with no peer, nothing can be
        # pending on it, so destroying it at exit cannot block (probe.close runs first: atexit is LIFO).
        atexit.register(_destroy_default_group)


def attach(run_dir: str | os.PathLike, *, timeout_s: float = 600.0, backend: str | None = None,
           manage_status: bool | None = None, run_id: str | None = None, **collect: Any) -> Probe | NullProbe:
    """Instrument this worker: returns a ``Probe`` (or a ``NullProbe`` with ``enabled=False``).

    - ``collect``: the ``CollectConfig`` fields (``collectives``, ``devices``, ``device_interval_s``,
      ``profile_steps``, ``enabled``, ...).
    - Initializes ``torch.distributed`` from the torchrun environment (``env://``; a 1-rank group without it)
      if not yet initialized, on ``backend`` (default: ``"nccl"`` with CUDA, else ``"gloo"``) with ``timeout_s``.
      Then, initialized by it or before it (the script or a framework called ``init_process_group``), a gloo or
      NCCL default group is wrapped in a recording group registered in its place: the default group's
      collectives from now on, and every group, DeviceMesh, DDP, FSDP2 or DTensor layout created after attach,
      are recorded, and ``dist.get_backend()`` answers the backend's own name; groups created before are named
      in one warning with the fix (see ``_record_initialized_groups``).
    - Once per process: while the probe it returned is open, a second call (also one that initializes
      torch.distributed under ``dtprobe launch``, whose worker attaches then) returns that probe instead of
      recording twice, with a warning when its run directory or options differ; the caller marks the steps
      from then on (``dtprobe launch``'s hook-driven steps stop).
    - Measures the clock offset to rank 0, writes ``ranks/rankNNNNN.json``; the leader creates ``run.json``
      when absent (attach mode); starts the device sampler; arms the profiler window.
    - ``manage_status``: whether the leader sets the run status at close (default: True unless launched by
      ``dtprobe run``, i.e. ``DTPROBE_JOB`` is unset). ``probe.close`` also runs at exit, and on SIGTERM
      (``close_on_sigterm``, from the main thread only: see ``dtprobe.collectors.sigterm``).
    """
    global _OPEN_PROBE
    unknown = set(collect) - _CONFIG_FIELDS
    if unknown:
        raise ConfigError(f"dtprobe.attach got unknown options {sorted(unknown)}; valid: "
                          f"{sorted(_CONFIG_FIELDS)} plus timeout_s, backend, manage_status, run_id.")
    config = CollectConfig(**collect)
    run_dir = Path(run_dir)
    if manage_status is None:
        manage_status = "DTPROBE_JOB" not in os.environ
    cuda = torch.cuda.is_available()
    local_rank = _env_int("LOCAL_RANK", 0)

    if _OPEN_PROBE is not None:
        return _reuse_open_probe(_OPEN_PROBE, run_dir, config)
    register_backends()      # the backends later groups are recorded on (record_new_groups); batch p2p coalescing
    owns_process_group = not dist.is_initialized()
    recording = config.enabled and config.collectives
    if owns_process_group:
        _init_process_group(backend or ("nccl" if cuda else "gloo"), timeout_s=timeout_s, local_rank=local_rank)
        if _OPEN_PROBE is not None:      # `dtprobe launch` attaches as init_process_group returns
            return _reuse_open_probe(_OPEN_PROBE, run_dir, config)
    if recording:
        _record_initialized_groups(nccl_timing=config.nccl_timing)

    rank, world_size = dist.get_rank(), dist.get_world_size()
    default_backend = str(dist.get_backend())
    device = f"cuda:{torch.cuda.current_device()}" if cuda and "nccl" in default_backend else "cpu"
    if not config.enabled:
        return NullProbe(run_dir, rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                         config=config)

    probe = Probe(run_dir, config, rank=rank, world_size=world_size, local_rank=local_rank,
                  node_rank=_env_int("GROUP_RANK", 0), restart=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
                  device=device, manage_status=manage_status)
    probe.owns_process_group = owns_process_group

    # Clock offset to rank 0 over a CPU-capable group (not recorded).
    clock_group = None if "gloo" in default_backend else dist.new_group(backend="gloo")
    with RECORDER.paused():
        clock_sample = measure_clock_sample(clock_group, rounds=config.clock_rounds)
    probe.clock_offset_ns, probe.clock_rtt_ns = clock_sample.offset_ns, clock_sample.rtt_ns

    if probe.is_leader and manage_status and not (run_dir / MANIFEST_FILE).exists():
        store_manifest.create_manifest(
            run_dir, run_id=run_id or run_dir.name, command=[sys.executable, *sys.argv],
            config={"collect": asdict(config)}, world_size=world_size, nnodes=_env_int("GROUP_WORLD_SIZE", 1))
    on_gpu = device.startswith("cuda")
    store_manifest.write_rank_info(
        run_dir, rank, host=socket.gethostname(), node_rank=probe.node_rank, local_rank=local_rank,
        device=device, pid=os.getpid(), clock_offset_ns=probe.clock_offset_ns, restart=probe.restart,
        device_name=torch.cuda.get_device_name(torch.cuda.current_device()) if on_gpu else None)
    if on_gpu:                           # steps and pipeline actions on CUDA events (collectors.training)
        training.use_device_clock(clock_for(torch.cuda.current_device()))
    probe._lifecycle("attach")
    if world_size > 1:                   # the first sample of the clock model (the reader's clock_sync)
        probe.writer.write("clock", clock_sample.row(restart=probe.restart, event="attach"))
    probe.writer.flush()
    if config.clock_interval_s > 0 and clock_sample.num_other_clocks:
        # Re-measured in a thread over a gloo group of its own (collective: every rank creates it, also on
        # NCCL jobs; not when every rank reads rank 0's clock), with a short timeout: a dead peer ends the
        # thread, never the job.
        resync_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=RESYNC_TIMEOUT_S))
        probe._clock = start_clock_resync(resync_group, interval_s=config.clock_interval_s,
                                          rounds=config.clock_rounds, offset_ns=probe.clock_offset_ns,
                                          restart=probe.restart, write=lambda row: probe.writer.write("clock", row))

    if config.collectives:
        RECORDER.start(probe.writer, timing=config.collective_timing, nccl_timing=config.nccl_timing,
                       flush_interval_s=config.flush_interval_s, restart=probe.restart)
    if config.devices:
        gpu_index = gpu_uuid = None
        if device.startswith("cuda"):
            gpu_index = torch.cuda.current_device()
            gpu_uuid = str(getattr(torch.cuda.get_device_properties(gpu_index), "uuid", "")) or None
        probe._sampler = DeviceSampler(probe.writer, interval_s=config.device_interval_s, gpu_index=gpu_index,
                                       gpu_uuid=gpu_uuid, step_fn=lambda: probe.current_step)
        probe._sampler.start()
    if config.profile_steps is not None:
        first, last = config.profile_steps
        probe._profiler = ProfilerWindow(run_dir, rank, first=first, last=last,
                                         record_shapes=config.profile_record_shapes,
                                         cuda=device.startswith("cuda"))
    atexit.register(probe._close_at_exit)
    if config.close_on_sigterm:
        sigterm.install(lambda: probe.close(status="crashed", reason="SIGTERM"))
    _OPEN_PROBE = probe
    return probe
