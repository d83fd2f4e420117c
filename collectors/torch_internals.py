"""Every private ``torch.distributed`` surface dtprobe relies on, in one place, each with what it is and why.

torch changes these between releases without notice; keeping them here means a torch upgrade breaks one module,
and the tests of this module (``tests/test_torch_internals.py``) say which surface moved. Checked against the torch
this project installs (2.13). Nothing else in dtprobe reaches into ``torch.distributed``'s private names.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

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
