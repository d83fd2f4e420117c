"""Every private ``torch.distributed`` surface dtprobe relies on, in one place, each with what it is and why.

torch changes these between releases without notice; keeping them here means a torch upgrade breaks one module,
and the tests of this module (``tests/test_torch_internals.py``) say which surface moved. Checked against the torch
this project installs (2.13). Nothing else in dtprobe reaches into ``torch.distributed``'s private names.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist


# ---- NCCL device timing (issue 15; used by collectors/nccl.py) ----

def enable_collectives_timing(pg: Any) -> None:
    """Switch on start/end CUDA events for every later collective of ``pg`` (``ProcessGroup
    ._enable_collectives_timing``: each backend's ``enableCollectivesTiming``; ProcessGroupNCCL's sets the flag that
    ``TORCH_NCCL_ENABLE_TIMING=1`` sets at construction). Needed for ``WorkInfo.active_duration`` and the hook."""
    pg._enable_collectives_timing()


def register_completion_hook(pg: Any, hook: Callable[[Any], None]) -> None:
    """Have ``hook(work_info)`` called for every completed work of ``pg`` (``ProcessGroup
    ._register_on_completion_hook``; NCCL only, one hook per group, called on the watchdog's hook thread).
    ``WorkInfo`` (torch 2.13): ``op_type`` (``OpType``), ``seq`` (the backend's collective counter, or its p2p
    counter for send/recv and coalesced p2p), ``time_started``/``time_finished`` (``std::chrono::steady_clock``
    time points: ``datetime.timedelta`` since the steady clock's epoch; older releases used the system clock,
    a ``datetime``), ``active_duration`` (``timedelta``, start to end CUDA event of the work)."""
    pg._register_on_completion_hook(hook)


def collective_seq(pg: Any) -> int:
    """The backend's collective counter now (``_get_sequence_number_for_group``; ProcessGroupNCCL returns
    ``seqCollective_``, bumped once per collective and once per coalescing block): read right after issuing a
    collective, the ``WorkInfo.seq`` its completion will carry."""
    return int(pg._get_sequence_number_for_group())


def split_from_bound_default(options: Any, global_ranks: list[int]) -> bool:
    """For a new NCCL group whose default group is bound to a device (``init_process_group(device_id=...)``): set
    ``options.split_from``/``split_color`` as torch's ``_new_process_group_helper`` does for its own NCCL groups,
    so the new communicator is split from the default one (``ncclCommSplit``), the split the ranks outside the new
    group join (torch calls ``perform_nocolor_split`` on them). Returns False, changing nothing, when the default
    group is not bound or its backend cannot split (``_get_split_source``)."""
    c10d = dist.distributed_c10d
    if not c10d.is_initialized():
        return False
    default = c10d._get_default_group()
    if default.bound_device_id is None:
        return False
    source = c10d._get_split_source(default)
    if source is None:
        return False
    options.split_from = source
    options.split_color = c10d._process_group_color(list(global_ranks))
    return True


def install_batch_p2p_coalescing(is_recording_group: Callable[[Any], bool]) -> None:
    """Make ``dist.batch_isend_irecv`` coalesce on recording groups as it does on plain ones. Idempotent.

    torch 2.13 coalesces a batch (one NCCL group call, needed for large activations exchanged both ways) only when
    ``type(group) is ProcessGroup``; a subclass such as dtprobe's recording group gets one send/recv at a time,
    the classic NCCL deadlock. On a group for which ``is_recording_group(group)`` holds and whose backend
    ``supports_coalescing`` (NCCL; gloo does not), the replacement runs the batch inside
    ``distributed_c10d._coalescing_manager(group, device, async_ops=True)`` exactly as torch does for a plain
    group (``group._start_coalescing`` / ``_end_coalescing``), and returns ``cm.works``; anything else goes to
    torch's own function.
    """
    c10d = dist.distributed_c10d
    original = c10d.batch_isend_irecv
    if getattr(original, "_dtprobe_coalescing", False):
        return

    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list: list) -> list:
        group = p2p_op_list[0].group if p2p_op_list else None
        if group is None and p2p_op_list:
            group = c10d._get_default_group()
        if group is None or not is_recording_group(group):
            return original(p2p_op_list)
        device = p2p_op_list[0].tensor.device
        if not group._get_backend(device).supports_coalescing:
            return original(p2p_op_list)
        c10d._check_p2p_op_list(p2p_op_list)
        with c10d._coalescing_manager(group, device, async_ops=True) as cm:
            for op in p2p_op_list:
                peer = {"group_dst" if op.op is c10d.isend else "group_src": op.group_peer}
                op.op(op.tensor, group=op.group, tag=op.tag, **peer)
        return cm.works

    batch_isend_irecv._dtprobe_coalescing = True   # type: ignore[attr-defined]
    c10d.batch_isend_irecv = batch_isend_irecv
    dist.batch_isend_irecv = batch_isend_irecv


# ---- the group registry (issue 16: attach after init_process_group; used by collectors/attach.py) ----
#
# ``distributed_c10d._world`` holds every group: ``default_pg`` (what ``_get_default_group()``, ``dist.group.WORLD``
# and every call without ``group=`` use), and per group ``pg_map`` (backend name, store), ``pg_names`` (its name),
# ``pg_group_ranks`` (global rank -> group rank), ``pg_backend_config`` ("cpu:gloo,cuda:gloo"), ``pg_to_tag`` /
# ``tags_to_pg`` (the tag lists functional collectives search by ranks). Separately, a C++ registry maps each group
# name to its group: DeviceMesh, DTensor and functional collectives keep names, not groups, and find the group with
# ``_resolve_process_group(name)`` at every call.

def default_group() -> Any:
    """The default group (``distributed_c10d._get_default_group()``); torch.distributed must be initialized."""
    return dist.distributed_c10d._get_default_group()


def group_device_backends(pg: Any) -> dict[str, str]:
    """Device type -> backend name of a registered group, from ``_world.pg_backend_config`` (``"cpu:gloo,cuda:gloo"``
    -> ``{"cpu": "gloo", "cuda": "gloo"}``; a plain name such as ``"dtprobe_gloo"`` -> ``{"": "dtprobe_gloo"}``)."""
    config = dist.distributed_c10d._world.pg_backend_config.get(pg, "")
    out: dict[str, str] = {}
    for part in filter(None, config.split(",")):
        device, sep, name = part.partition(":")
        out[device if sep else ""] = (name if sep else device).strip().lower()
    return out


def backend_devices(backend: str) -> dict[str, str]:
    """Device type -> backend name of a group created on ``backend`` (``distributed_c10d.BackendConfig``): ``"gloo"``
    -> ``{"cpu": "gloo", "cuda": "gloo"}``, ``"undefined"`` (what ``init_process_group()`` without a backend
    registers) -> torch's default per device (``{"cpu": "gloo"}`` on a CPU build), ``"cpu:gloo,cuda:nccl"`` as
    written; ``{}`` for a string torch refuses (``"cpu:gloo,"``)."""
    try:
        return dict(dist.distributed_c10d.BackendConfig(dist.Backend(backend)).get_device_backend_map())
    except ValueError:
        return {}


def registered_groups() -> list[tuple[Any, str, str, list[int]]]:
    """Every registered group as ``(group, name, description, global ranks)``, in creation order (``_world.pg_names``
    and ``pg_group_ranks``; the description is ``group_desc``, e.g. ``"mesh_tp"`` for a DeviceMesh axis)."""
    world = dist.distributed_c10d._world
    return [(pg, str(name), str(getattr(pg, "group_desc", "") or ""), sorted(world.pg_group_ranks.get(pg, {})))
            for pg, name in list(world.pg_names.items())]


def replace_default_group(wrapper: Any) -> Any:
    """Make ``wrapper`` (a ``ProcessGroup`` forwarding to the current default group) the default group everywhere
    torch looks for it; returns the old group.

    - ``_world.default_pg`` (``_update_default_pg``): ``_get_default_group()``, ``dist.group.WORLD`` and every
      call without ``group=`` (DDP, FSDP2's and DeviceMesh's default group) get ``wrapper``.
    - ``pg_map``, ``pg_names``, ``pg_group_ranks``, ``pg_backend_config`` copied from the old group: ``wrapper``
      keeps its backend name, so ``dist.get_backend()`` still says ``"gloo"``/``"nccl"`` (Lightning, DeviceMesh and
      others branch on it) and ``new_group`` without a backend asks for the same one (see ``record_new_groups``).
    - the tags (``wrapper`` listed before the old group, so a search by ranks finds it first) and the C++ name
      registry (``_unregister_process_group`` then ``_register_process_group``): a DeviceMesh or DTensor holding
      the default group's name resolves to ``wrapper``, even one built before this call.

    The old group stays registered, so objects holding it (a DDP built before) keep working, unrecorded.
    ``destroy_process_group()`` then shuts it down twice (directly and through ``wrapper``), which gloo accepts.
    """
    c10d = dist.distributed_c10d
    world = c10d._world
    old = c10d._get_default_group()
    name = world.pg_names[old]
    wrapper._set_group_name(name)
    wrapper._set_group_desc(old.group_desc)
    world.pg_map[wrapper] = world.pg_map[old]
    world.pg_names[wrapper] = name
    world.pg_group_ranks[wrapper] = dict(world.pg_group_ranks[old])
    world.pg_backend_config[wrapper] = world.pg_backend_config[old]
    tag = world.pg_to_tag.get(old)
    if tag is not None:
        world.pg_to_tag[wrapper] = tag
        for pgs in world.tags_to_pg.values():
            if old in pgs and wrapper not in pgs:
                pgs.insert(pgs.index(old), wrapper)
    c10d._unregister_process_group(name)
    c10d._register_process_group(name, wrapper)
    c10d._update_default_pg(wrapper)
    return old


def record_new_groups(recording_backend: Callable[[str], str | None]) -> None:
    """Create later groups asked for on a backend ``recording_backend(name)`` maps (``"gloo"`` -> ``"dtprobe_gloo"``)
    on the mapped backend instead, registered under the name asked for. Idempotent (the first mapping stays).

    Every group torch creates (``new_group``, ``new_subgroups``, DeviceMesh axes, ``init_process_group``) goes through
    ``distributed_c10d._new_process_group_helper(size, rank, ranks, backend, store, name, ...)``, which registers
    the group under ``backend`` (``pg_map``, ``pg_backend_config``). The replacement calls it with the mapped
    backend, then writes the requested name back, so ``dist.get_backend(group)`` is what the caller asked for
    while the group itself records. Names the mapping returns None for (mixed ``"cpu:gloo,cuda:nccl"``, MPI,
    other plugins) are created as asked.
    """
    c10d = dist.distributed_c10d
    original = c10d._new_process_group_helper
    if getattr(original, "_dtprobe_recording", False):
        return

    @functools.wraps(original)
    def _new_process_group_helper(group_size: int, group_rank: int, global_ranks_in_group: Any, backend: Any,
                                  store: Any, group_name: Any, *args: Any, **kwargs: Any) -> Any:
        mapped = recording_backend(str(backend))
        if mapped is None:
            return original(group_size, group_rank, global_ranks_in_group, backend, store, group_name, *args,
                            **kwargs)
        pg, prefix_store = original(group_size, group_rank, global_ranks_in_group, dist.Backend(mapped), store,
                                    group_name, *args, **kwargs)
        world = c10d._world
        if pg in world.pg_map:          # a member: registered under the recording backend, renamed back
            world.pg_map[pg] = (backend, world.pg_map[pg][1])
            world.pg_backend_config[pg] = str(c10d.BackendConfig(backend))
        return pg, prefix_store

    _new_process_group_helper._dtprobe_recording = True   # type: ignore[attr-defined]
    c10d._new_process_group_helper = _new_process_group_helper


def resolve_group(name: str) -> Any:
    """The group registered under ``name`` in the C++ registry (``_resolve_process_group``): what DeviceMesh,
    DTensor and functional collectives call with the names they hold."""
    return dist.distributed_c10d._resolve_process_group(name)


# ---- autograd (issue 16: backward phase of an unmodified script; used by collectors/launch_steps.py) ----

def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the backward pass running now finishes (``Variable._execution_engine.queue_callback``,
    what DDP's reducer and FSDP use to finalize gradients). Call it from inside a backward hook only."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ---- futures (used by collectors/recorded_work.py to stamp a future-waited collective on the caller's thread) ----

set_future_unwrap: Callable[[Any, Callable[[Any], None]], None] | None = getattr(
    torch.futures.Future, "_set_unwrap_func", None)
"""``set_future_unwrap(future, fn)``: have ``fn(value)`` called on the caller's thread each time a Python
``wait()`` or ``value()`` of ``future`` returns, not when the future failed (``torch._C.Future._set_unwrap_func``,
the hook of the C++ future's Python wrapper); None on a torch without it. The unbound method itself, so the hot
path pays no extra call."""


# ---- torchrun's worker start (used by dtprobe/runtime/fork_start.py: workers forked from a warm agent) ----

def subprocess_handler_class() -> type | None:
    """torchrun's ``SubprocessHandler`` (public name) if it still makes the worker's process in one private step,
    ``_popen(args, env)`` (called from ``__init__`` after the stdout/stderr files are opened), which the fork
    start overrides; None on a torch without it (workers then start by exec)."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    except ImportError:
        return None
    return SubprocessHandler if callable(getattr(SubprocessHandler, "_popen", None)) else None


def replace_subprocess_handler(factory: Callable[..., Any]) -> bool:
    """Have torchrun build every worker's handler with ``factory`` (the arguments of the public
    ``get_subprocess_handler``): ``SubprocessContext._start`` calls that function through the module name
    ``torch.distributed.elastic.multiprocessing.api.get_subprocess_handler``, which is replaced. False, nothing
    changed, on a torch without that name."""
    from torch.distributed.elastic.multiprocessing import api

    if not callable(getattr(api, "get_subprocess_handler", None)):
        return False
    api.get_subprocess_handler = factory
    return True
