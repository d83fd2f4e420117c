"""A plain torchrun DDP script (no dtprobe) training the same GPT as `dtprobe run`: the runtime's baseline.

torchrun --standalone --nproc-per-node 2 benchmarks/plain_ddp.py --steps 100 --batch-size 8 --seq-len 64 --out t.json
"""
import argparse, json, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from dtprobe.runtime.model import build_model, lm_loss

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100); p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq-len", type=int, default=64); p.add_argument("--model", default="tiny")
p.add_argument("--bucket-mb", type=float, default=25.0); p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(build_model(args.model, seed=0), bucket_cap_mb=args.bucket_mb)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(rank)
times = []
for step in range(args.steps):
    t0 = time.perf_counter()
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=gen)
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    opt.zero_grad(set_to_none=True); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    loss.item(); times.append(time.perf_counter() - t0)
if rank == 0:
    json.dump({"step_s": times}, open(args.out, "w"))
dist.destroy_process_group()
