"""A ``dtprobe run`` worker whose attach (joining the process group) has not returned after half the job's timeout
writes every thread's stack to its stderr (``runtime.worker.stacks_if_slow``), and says nothing when it returns
in time."""

from __future__ import annotations

SNIPPET = """
import sys, threading, time
from dtprobe.runtime.worker import stacks_if_slow

def joining_the_group(seconds):
    time.sleep(seconds)

after_s, body_s = float(sys.argv[1]), float(sys.argv[2])
threading.Thread(target=time.sleep, args=(body_s + 2,), name="sampler", daemon=True).start()
with stacks_if_slow(after_s):
    joining_the_group(body_s)
time.sleep(after_s + 0.5)          # a dump armed but not cancelled would land here
print("done")
"""


def test_an_attach_still_running_after_the_delay_leaves_every_threads_stack_on_stderr(run_python):
    proc = run_python(SNIPPET, "0.5", "2.0", timeout_s=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
    assert "Timeout (0:00:00.500000)!" in proc.stderr
    assert proc.stderr.count("Thread 0x") == 2                       # the main thread and the other one
    assert 'in joining_the_group' in proc.stderr


def test_an_attach_that_returns_in_time_leaves_nothing(run_python):
    proc = run_python(SNIPPET, "1.0", "0.1", timeout_s=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
    assert proc.stderr == ""
