"""One causal self-attention step (forward and backward) on the CPU: memwise's memory-efficient
and materialising kernels against PyTorch's ``scaled_dot_product_attention`` at its fastest
setting, side by side in one run (docs/BENCHMARKS.md, "Attention at sequence 1024").

memwise: ``kernels/examples/attention_bench.rs`` (release build), in a fresh process per round.
PyTorch: the same shape from the same packed ``qkv [batch, seq, 3·hidden]`` (viewed as q, k, v of
``[batch, heads, seq, head_dim]``, as a GPT block does), under every available SDPA backend
(``FLASH_ATTENTION``, ``MATH``) and 1 or 2 threads; the fastest forward and the fastest
forward + backward are reported. The rounds alternate memwise and PyTorch; the median over
rounds of each one's fastest time is printed.

It also counts what each keeps for the backward: memwise's log-sum-exp (or, materialising,
the probabilities), and PyTorch's saved tensors (``torch.autograd.graph.saved_tensors_hooks``,
by storage, the input qkv excluded since both keep it).

    bash bench/setup.sh                     # once
    bench/.venv/bin/python bench/attention.py [--batch 2 --seq 1024 --heads 12 --head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def memwise(args) -> dict:
    # Where cargo put it: CARGO_TARGET_DIR when set (as for the build below), else target/.
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    exe = os.path.join(target, "release", "examples", "attention_bench")
    out = subprocess.run(
        [exe, str(args.batch), str(args.seq), str(args.heads), str(args.head_dim), "1", str(args.reps)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def torch_step(args, threads: int, backend) -> dict:
    import torch
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    qkv = (torch.rand(b, s, 3 * h * d, generator=g) * 2 - 1).requires_grad_(True)
    dctx = torch.rand(b, h, s, d, generator=g) * 2 - 1

    def parts():
        q, k, v = qkv.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
        return q, k, v

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*parts(), is_causal=True)

    def fastest(f) -> float:
        f()
        best = float("inf")
        for _ in range(args.reps):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        return best * 1e3

    with torch.no_grad():
        fwd_ms = fastest(fwd)

    def step():
        qkv.grad = None
        fwd().backward(dctx)

    step_ms = fastest(step)
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr():
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd()
    return {"fwd_ms": fwd_ms, "step_ms": step_ms, "kept_bytes": sum(saved.values())}


def torch_best(args) -> dict:
    from torch.nn.attention import SDPBackend

    best = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        for threads in (1, 2):
            try:
                r = torch_step(args, threads, backend)
            except RuntimeError as e:  # a backend this build or shape does not offer
                print(f"  skipped {backend.name}, {threads} threads: {e}", file=sys.stderr)
                continue
            r["setting"] = f"{backend.name}, {threads} thread(s)"
            if best is None or r["step_ms"] < best["step_ms"]:
                best = r
    return best


def torch_block_kept(batch: int, dropout: float) -> tuple[int, str]:
    """Bytes a float32 GPT-2 block (pre-LN, causal SDPA, GELU MLP, dropout on the attention
    probabilities and both residual branches) saves for its backward in PyTorch: every saved
    tensor's storage once, parameters excluded; and the SDPA backend that ran."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h, heads, s = 768, 12, 1024

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc, self.proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
            self.drop = nn.Dropout(dropout)

        def forward(self, x):
            b = x.shape[0]
            q, k, v = self.c_attn(self.ln_1(x)).view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
            x = x + self.drop(self.c_proj(a.transpose(1, 2).reshape(b, s, h)))
            return x + self.drop(self.proj(F.gelu(self.fc(self.ln_2(x)))))

    block = Block().train()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(batch, s, h, requires_grad=True)
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    seen, names, todo = set(), set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(node.name())
        todo.extend(n for n, _ in node.next_functions)
    flash = any("FlashAttention" in n for n in names)
    backend = "flash" if flash else "math (materialising)"
    return sum(saved.values()), backend


def memwise_block_kept(batch: int, dropout: float) -> tuple[int, str]:
    out = subprocess.run(
        ["cargo", "run", "--release", "-q", "-p", "memwise-plan", "--features", "test-models",
         "--example", "gpt2_block_kept", "--", str(batch), str(dropout)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    ).stdout
    r = json.loads(out)
    return sum(t["bytes"] for t in r["kept"]), r["attention"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "memwise-kernels", "--example", "attention_bench"],
        check=True,
        cwd=ROOT,
    )
    mw, pt = [], []
    for _ in range(args.rounds):
        mw.append(memwise(args))
        pt.append(torch_best(args))
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    flash_step = statistics.median(r["flash_fwd_ms"] + r["flash_bwd_ms"] for r in mw)
    mat_step = statistics.median(r["materialised_fwd_ms"] + r["materialised_bwd_ms"] for r in mw)
    torch_step_ms = med(pt, "step_ms")
    load = os.getloadavg()[0]
    print(f"causal attention b{args.batch} s{args.seq} heads {args.heads} d{args.head_dim}, float32, "
          f"{args.rounds} rounds, load {load:.2f}; PyTorch's fastest: {pt[-1]['setting']}")
    print("| kernel | forward ms | forward + backward ms | / PyTorch | kept for backward |")
    print("|---|--:|--:|--:|--:|")
    print(f"| memwise memory-efficient | {med(mw, 'flash_fwd_ms'):.1f} | {flash_step:.1f} | "
          f"{flash_step / torch_step_ms:.2f} | {mw[0]['flash_kept_bytes']:,} B |")
    print(f"| memwise materialising | {med(mw, 'materialised_fwd_ms'):.1f} | {mat_step:.1f} | "
          f"{mat_step / torch_step_ms:.2f} | {mw[0]['materialised_kept_bytes']:,} B |")
    print(f"| PyTorch SDPA | {med(pt, 'fwd_ms'):.1f} | {torch_step_ms:.1f} | 1.00 | "
          f"{pt[0]['kept_bytes']:,} B |")
    print(f"\nGPT-2 block, float32, batch {args.batch}, sequence 1024, kept for backward:")
    print("| | memwise | PyTorch | memwise / PyTorch |")
    print("|---|--:|--:|--:|")
    for dropout in (0.1, 0.0):
        mb, mop = memwise_block_kept(args.batch, dropout)
        tb, top = torch_block_kept(args.batch, dropout)
        note = f"dropout {dropout}: memwise `{mop}`, PyTorch `{top}`"
        print(f"| {note} | {mb:,} B | {tb:,} B | {mb / tb:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
