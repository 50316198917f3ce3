"""Train a small GPT with hapc under torchrun (CPU/gloo here; NCCL on GPUs).

    torchrun --nproc-per-node 3 examples/train_gpt.py --cluster local-cpu:3 --steps 10

Every rank builds the same model (same seed), hapc.compile synthesizes the plan on rank 0 and
shares it, and each rank trains its part with an ordinary optimizer. Checkpoints are full
single-device state dicts: resume them under any plan or world size.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import hapc
from hapc import models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="local-cpu:3", help="a preset, or the TOML hapc profile wrote")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--checkpoint", default="gpt-ckpt.pt")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)

    model, (idx, targets) = models.load("gpt-small", batch=6)
    module = hapc.compile(model, args.cluster, (idx, targets))
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    if os.path.exists(args.checkpoint):
        module.load_full_state_dict(hapc.checkpoint.load(args.checkpoint), opt)
    for step in range(args.steps):
        opt.zero_grad()
        loss = module(idx, targets)  # the global batch: each rank takes its share
        loss.backward()
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")  # the full loss, on every rank
    state = module.full_state_dict(opt)
    if dist.get_rank() == 0:
        hapc.checkpoint.save(state, args.checkpoint)
        print(f"saved {args.checkpoint}; rank 0's program:\n{module.code[:600]}...")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
