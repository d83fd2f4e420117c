"""A user's torchrun job with one rank issuing the wrong collective: the chaos suite's COLLECTIVE_MISMATCH case.

Every rank all_reduces its flattened gradients each step (hand-written data parallelism, with ``dtprobe.attach``);
at ``--odd-step`` the ``--odd-rank`` all_gathers them instead ("incorrect ordering of collective operations").
gloo then waits on both sides until the process-group timeout and every rank dies of it. With ``--odd-end`` the
odd rank instead runs out of data before ``--odd-step`` and its script ends normally (uneven inputs), while its
peers enter that step's all-reduce; they fail once the connection to it closes. With ``--rank0-metric`` every rank
runs every step and rank 0 alone all-reduces a metric after the loop (a collective under ``if rank == 0:``), while
the others' scripts end; it fails once their connections close. With ``--odd-extra N`` the odd rank all_reduces N
more elements than its peers at ``--odd-step`` (a flat buffer over a parameter list that differs per rank); gloo's
size check then aborts the member that receives the larger message.

    torchrun --standalone --nproc-per-node 3 tests/chaos/mismatch_job.py RUN_DIR --odd-rank 2 --odd-step 4
"""

import argparse

import torch
import torch.distributed as dist

import dtprobe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--odd-rank", type=int, default=1, help="the rank that issues the wrong collective")
    parser.add_argument("--odd-step", type=int, default=4, help="the step at which it does")
    parser.add_argument("--odd-end", action="store_true", help="the odd rank's data ends before --odd-step instead")
    parser.add_argument("--rank0-metric", action="store_true",
                        help="no odd rank: rank 0 alone all-reduces a metric after the loop instead")
    parser.add_argument("--odd-extra", type=int, default=0,
                        help="the odd rank all_reduces this many more elements instead of another collective")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pg-timeout-s", type=float, default=10.0, help="process-group timeout (the job's end)")
    args = parser.parse_args()

    probe = dtprobe.attach(args.run_dir, timeout_s=args.pg_timeout_s, devices=False)
    is_odd_rank = probe.rank == args.odd_rank and not args.rank0_metric
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(probe.rank)
    for step in range(args.steps):
        if is_odd_rank and args.odd_end and step == args.odd_step:
            break                                             # the bug: its shard had fewer batches
        with probe.step(step) as s:
            with s.phase("data"):
                x = torch.randn(8, 32, generator=gen)
            with s.phase("fwd"):
                loss = (model(x) - x).pow(2).mean()
            with s.phase("bwd"):
                loss.backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters()])
                if is_odd_rank and step == args.odd_step and args.odd_extra:
                    dist.all_reduce(torch.cat([grads, torch.zeros(args.odd_extra)]))   # the bug: a longer buffer
                elif is_odd_rank and step == args.odd_step:
                    gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
                    dist.all_gather(gathered, grads)          # the bug: its peers all_reduce here
                else:
                    dist.all_reduce(grads)
                grads /= dist.get_world_size()
            with s.phase("opt"):
                offset = 0
                for p in model.parameters():
                    p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
                opt.step()
                opt.zero_grad()
            s.record(loss=loss.item(), tokens=x.numel())
    if args.rank0_metric and probe.rank == 0:
        dist.all_reduce(loss.detach())                        # the bug: only rank 0 reaches it
    probe.close()


if __name__ == "__main__":
    main()
