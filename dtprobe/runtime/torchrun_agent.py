"""torchrun's agent as ``dtprobe run`` and ``dtprobe launch`` start it: ``python -m dtprobe.runtime.torchrun_agent
ARGS`` is ``python -m torch.distributed.run ARGS`` (same arguments, log lines, error file and exit codes) that,
when every worker succeeded, ends through ``runtime.quick_exit`` instead of tearing torch down, so the launcher
can finalize the run sooner. A failure (torchrun's ``ChildFailedError`` and any other exception) takes the normal
exit path unchanged.
"""

from __future__ import annotations

if __name__ == "__main__":
    from torch.distributed.run import main

    from dtprobe.runtime.quick_exit import quick_exit

    main()
    quick_exit(0)
