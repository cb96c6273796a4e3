"""PyTorch DistributedDataParallel side of bench/data_parallel.sh: the MNIST MLP
(784-512-10, ReLU, softmax cross-entropy, RMSprop at Keras's defaults) trained data-parallel
over the gloo backend, one process per rank, on uint8 pixels scaled on the fly as memwise's
`mnist_mlp` does. Launch it with torchrun:

    bench/.venv/bin/torchrun --nproc_per_node 2 bench/ddp.py --batch 4096 --steps 30

`--batch` is the global batch (each rank takes its share). Each rank prints one JSON line:
samples/s of the whole job over the timed steps (after `--warmup`), the median step, and the
peak resident growth measured as memwise's MemoryMonitor does (bench/twins.py: VmHWM minus the
resident size just before the model is built, the peak reset there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from twins import release_free_heap, reset_peak, rss_bytes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128, help="the global batch")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split over {world} ranks")
    per = args.batch // world
    gen = torch.Generator().manual_seed(rank)
    pixels = torch.randint(0, 256, (per, 784), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 10, (per,), generator=gen)

    release_free_heap()
    base, _ = rss_bytes()
    peak_reset = reset_peak()
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)

    step_ms = []
    for s in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(ddp(pixels.float() * (1.0 / 255.0)), labels)
        loss.backward()
        opt.step()
        if s >= args.warmup:
            step_ms.append((time.perf_counter() - t0) * 1e3)
    _, hwm = rss_bytes()
    median = statistics.median(step_ms)
    print(json.dumps({
        "framework": "torch-ddp", "torch": torch.__version__, "rank": rank, "ranks": world,
        "threads": args.threads, "global_batch": args.batch, "step_ms_median": median,
        "job_samples_per_s": args.batch / (median / 1e3),
        "peak_rss_growth_bytes": hwm - base if peak_reset else None,
    }))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
