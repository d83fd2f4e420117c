"""torchrun's agent as ``dtprobe run`` and ``dtprobe launch`` start it: ``python -m dtprobe.runtime.torchrun_agent
ARGS`` is ``python -m torch.distributed.run ARGS`` (same arguments, log lines, error file and exit codes) that,
when every worker succeeded, ends through ``runtime.quick_exit`` instead of tearing torch down, so the launcher
can finalize the run sooner. A failure (torchrun's ``ChildFailedError`` and any other exception) takes the normal
exit path unchanged.

When ARGS run ``-m dtprobe.runtime.worker`` (``dtprobe run``) and ``DTPROBE_WORKER_START`` is not ``exec``, the
agent first imports torch and the worker's modules, and starts each worker as a fork of its fork server, a copy
of itself made before torchrun starts any thread (``runtime.fork_start``); any other entrypoint (``dtprobe
launch``'s user scripts) is exec'd as torchrun does.
"""

from __future__ import annotations

if __name__ == "__main__":
    import sys

    from dtprobe.runtime import fork_start

    if fork_start.requested(sys.argv[1:]):
        fork_start.install()

    from torch.distributed.run import main

    from dtprobe.runtime.quick_exit import quick_exit

    main()
    quick_exit(0)
