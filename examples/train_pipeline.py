"""Pipeline a small GPT over two device groups with H-1F1B under torchrun (CPU/gloo here).

    torchrun --nproc-per-node 4 examples/train_pipeline.py --cluster examples/two-groups.toml

The cluster joins its groups by a slow link, so hapc.compile plans a HARP pipeline (rank 0 plans,
every rank receives the plan), synthesizes each stage's SPMD program for its sub-mesh, and returns
this rank's stage. ``train_step`` runs forward and backward of every micro-batch by the schedule.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import hapc
from hapc import models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="examples/two-groups.toml")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--schedule", default="h1f1b", choices=["h1f1b", "1f1b", "eager-1f1b"])
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model, batch = models.load("gpt-small", batch=8)
    module = hapc.compile(model, args.cluster, batch, num_micro=args.micro, schedule=args.schedule)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    if dist.get_rank() == 0:
        print(f"stages (ranks): {module.spec.ranks}, warm-up counts: {module.spec.warmups}")
    for step in range(args.steps):
        opt.zero_grad()
        loss = module.train_step(*batch)  # the batch loss, on every rank
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
