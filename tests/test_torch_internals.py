"""The private torch.distributed surfaces of ``collectors/torch_internals.py`` on the installed torch: each test
fails where a torch upgrade moved one. Each runs in a child process (a 1-rank gloo world on a HashStore), so no
process group outlives it."""

from __future__ import annotations

import textwrap

import pytest

_PRELUDE = """
import torch, torch.distributed as dist
from dtprobe.collectors import torch_internals as ti
from dtprobe.collectors.collective_recorder import RECORDER
from dtprobe.collectors.pg_wrapper import GLOO_BACKEND, RecordingProcessGroup, register_backends
register_backends()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""


def _check(run_python, body: str) -> None:
    proc = run_python(_PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n", timeout_s=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_group_device_backends_reads_the_backend_config_per_device(run_python):
    _check(run_python, """
        assert ti.group_device_backends(ti.default_group()) == {"cpu": "gloo", "cuda": "gloo"}
        sub = dist.new_group([0], backend=GLOO_BACKEND)
        assert ti.group_device_backends(sub) == {"cpu": "dtprobe_gloo"}
        assert ti.group_device_backends(object()) == {}          # not registered: nothing
    """)


@pytest.mark.parametrize("backend, devices", [
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("cpu:gloo", {"cpu": "gloo"}),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ("cpu:gloo,", {}),                              # refused by torch: no backend
])
def test_backend_devices_gives_the_backend_of_each_device_a_new_group_gets(backend, devices):
    from dtprobe.collectors import torch_internals as ti

    assert ti.backend_devices(backend) == devices


def test_registered_groups_lists_every_group_with_name_description_and_ranks_in_creation_order(run_python):
    _check(run_python, """
        sub = dist.new_group([0], group_desc="mine")
        groups = ti.registered_groups()
        assert [g for g, *_ in groups] == [ti.default_group(), sub]
        assert [tuple(rest) for _, *rest in groups] == [("0", "default_pg", [0]), (sub.group_name, "mine", [0])]
    """)


def test_replace_default_group_makes_the_wrapper_the_default_everywhere_and_keeps_the_old_group_usable(run_python):
    _check(run_python, """
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed.device_mesh import init_device_mesh

        old = ti.default_group()
        name = old.group_name
        wrapper = RecordingProcessGroup(old, 0, 1, backend_name=GLOO_BACKEND)
        assert ti.replace_default_group(wrapper) is old
        ti.record_new_groups({"gloo": GLOO_BACKEND}.get)
        assert ti.default_group() is wrapper and dist.group.WORLD is wrapper
        assert wrapper.group_name == name and wrapper.group_desc == "default_pg"
        assert ti.resolve_group(name) is wrapper                 # functional collectives and meshes find it
        assert dist.get_backend() == "gloo" and dist.get_process_group_ranks(wrapper) == [0]   # as frameworks expect
        assert ti.group_device_backends(wrapper) == {"cpu": "gloo", "cuda": "gloo"}
        assert dist.get_rank(old) == 0 and dist.get_world_size(old) == 1   # objects holding it keep working
        tag = dist.distributed_c10d._world.pg_to_tag[old]
        pgs = dist.distributed_c10d._world.tags_to_pg[tag]
        assert pgs.index(wrapper) < pgs.index(old)

        # groups made later on gloo, with or without naming it, are recording groups registered as gloo
        for later in (dist.new_group([0]), dist.new_group([0], backend="gloo")):
            assert isinstance(later, RecordingProcessGroup) and dist.get_backend(later) == "gloo"
            assert ti.group_device_backends(later) == {"cpu": "gloo", "cuda": "gloo"}
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        assert mesh.get_group("dp") is wrapper                   # an axis over all ranks reuses the default group
        ti.record_new_groups(lambda name: None)                  # idempotent: the first mapping stays
        assert isinstance(dist.new_group([0]), RecordingProcessGroup)

        class Sink:
            rows = []
            def write(self, table, row): self.rows.append((table, row))
        RECORDER.start(Sink(), flush_interval_s=60)
        t = torch.ones(3)
        dist.all_reduce(t)
        funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()
        dist.all_reduce(torch.ones(5), group=old)               # the old group itself: not recorded
        RECORDER.stop()
        rows = [r for table, r in Sink.rows if table == "collectives"]
        assert [(r["pg"], r["op"], r["num_bytes"]) for r in rows] == [("world", "allreduce", 12),
                                                                     ("world", "allreduce", 8)]
        dist.destroy_process_group()                             # shuts the old group down through both
        assert not dist.is_initialized()
    """)


def test_queue_backward_callback_runs_once_after_the_whole_backward_pass():
    import torch

    from dtprobe.collectors import torch_internals as ti

    events: list[str] = []
    w = torch.ones(3, requires_grad=True)
    hidden = w * 2

    def on_hidden(grad: torch.Tensor) -> None:
        events.append("hook")
        ti.queue_backward_callback(lambda: events.append("end"))

    hidden.register_hook(on_hidden)
    w.register_hook(lambda g: events.append("leaf") and None)      # the last gradient of the pass
    (hidden * 3).sum().backward()
    assert events == ["hook", "leaf", "end"]


def test_set_future_unwrap_calls_the_function_on_the_waiting_thread_after_each_python_wait(run_python):
    _check(run_python, """
        import threading
        calls = []
        fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
        ti.set_future_unwrap(fut, lambda value: calls.append((threading.get_ident(), value[0].sum().item())))
        assert calls == []                                  # not when the work completes: at a Python wait
        fut.wait()
        fut.value()
        assert calls == [(threading.get_ident(), 4.0)] * 2
        failed = torch.futures.Future()
        ti.set_future_unwrap(failed, calls.append)
        failed.set_exception(RuntimeError("boom"))
        try:
            failed.wait()
        except RuntimeError:
            pass
        assert len(calls) == 2                              # never for a failed future
    """)


@pytest.mark.multiproc
def test_torchrun_builds_each_workers_handler_through_the_replaced_function_and_its_popen_step(run_python, tmp_path):
    # what runtime/fork_start.py relies on: start_processes (torchrun's agent) gets every binary worker's handler
    # from the replaced get_subprocess_handler, and the handler makes the process in _popen
    proc = run_python(textwrap.dedent("""
        import sys
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler, handlers
        from dtprobe.collectors import torch_internals as ti
        base = ti.subprocess_handler_class()
        assert base is SubprocessHandler
        made = []

        class Recorded(base):
            def _popen(self, args, env):
                made.append((args[1:], env["PROBE"], self.local_rank_id))
                return super()._popen(args, env)

        def factory(**kwargs):
            return Recorded(**kwargs)

        assert ti.replace_subprocess_handler(factory)
        ctx = start_processes(name="probe", entrypoint=sys.executable,
                              args={0: ("-c", "pass"), 1: ("-c", "pass")}, envs={0: {"PROBE": "a"}, 1: {"PROBE": "b"}},
                              logs_specs=DefaultLogsSpecs(log_dir=sys.argv[1]))
        result = ctx.wait(60)
        assert not result.is_failed(), result.failures
        assert sorted(made) == [(("-c", "pass"), "a", 0), (("-c", "pass"), "b", 1)], made
        print("OK")
    """), tmp_path, timeout_s=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
