"""What one training step keeps from its forward pass for its backward pass: memwise against
PyTorch, model by model (docs/BENCHMARKS.md, "Kept for backward against PyTorch").

memwise: the example's plan (``--plan-json``); every activation or input tensor the forward
pass leaves alive for the loss and backward steps (alive across the first loss step), at its
exact size (elements × dtype, no arena alignment). Tensors a checkpointed segment drops and
recomputes are not alive there, and are not counted.

PyTorch: the twin of the same model (bench/twins.py: same layers, batch, dtypes, the initial
weights memwise wrote) runs one training step under ``torch.autograd.graph.saved_tensors_hooks``;
every tensor autograd saves is counted once per storage, by the storage's bytes, parameters
excluded. The twins pad explicitly where TensorFlow's "same" padding is asymmetric; a saved
padded copy is counted as the tensor it pads, which is what PyTorch's own (symmetric) padding
would keep.

    bash bench/setup.sh                      # once
    bench/.venv/bin/python bench/kept.py [--models convnet vae mnist_mlp gpt] [--markdown]

``gpt`` is `examples/user_models.rs`'s two-block mixed-float16 TinyGpt (sequence 32), against a
float16 PyTorch twin written here (``torch_gpt_kept``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import compare  # noqa: E402  (the release build of the examples, and where it lives)
import twins  # noqa: E402

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "u8": 1}


def memwise_kept(plan: dict) -> dict[str, int]:
    """Bytes of each tensor the forward pass leaves for the loss and backward steps (alive
    across the first loss step), by tensor name."""
    boundary = next(s["index"] for s in plan["steps"] if s["phase"] == "loss")
    kept = {}
    for t in plan["tensors"]:
        if t["role"] in ("activation", "input") and t["first"] < boundary <= t["last"]:
            elems = 1
            for d in t["shape"]:
                elems *= d
            kept[t["name"]] = elems * DTYPE_BYTES[t["dtype"]]
    return kept


def torch_kept(model: str, work: Path) -> dict[str, int]:
    """Bytes of each storage the twin's autograd saves in one step, parameters excluded."""
    import torch
    from safetensors import safe_open
    from safetensors.numpy import load_file

    weights = load_file(str(work / f"{model}.init.safetensors"))
    with safe_open(str(work / f"{model}.batches.safetensors"), "np") as f:
        meta = f.metadata()
        batches = {k: f.get_tensor(k) for k in f.keys()}
    net, train_step = twins.make_twin(model, weights, meta, torch.get_num_threads())
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    # The twins pad explicitly for TensorFlow's asymmetric "same" padding, which PyTorch's
    # convolutions and pools cannot express; their built-in (symmetric) padding would keep the
    # unpadded input instead. So a saved padded copy is counted as the tensor it pads.
    padded_from: dict[int, torch.Tensor] = {}
    pad = torch.nn.functional.pad

    def pad_and_remember(x, *args, **kwargs):
        y = pad(x, *args, **kwargs)
        padded_from[y.untyped_storage().data_ptr()] = x
        return y

    saved: dict[int, tuple[int, str]] = {}

    def pack(t):
        counted = padded_from.get(t.untyped_storage().data_ptr(), t)
        s = counted.untyped_storage()
        if s.data_ptr() not in params:
            saved.setdefault(s.data_ptr(), (s.nbytes(), f"{tuple(counted.shape)} {counted.dtype}"))
        return t

    inputs = {k: torch.from_numpy(v[0]) for k, v in batches.items()}
    torch.nn.functional.pad = pad_and_remember
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train_step(inputs, 0)
    finally:
        torch.nn.functional.pad = pad
    return {f"{desc} #{i}": n for i, (n, desc) in enumerate(saved.values())}


def torch_gpt_kept(batch: int = 32, seq: int = 32) -> dict[str, int]:
    """The same for a twin of `examples/user_models.rs`'s TinyGpt: token and learned position
    embeddings, two pre-norm blocks (LayerNorm, causal 4-head attention through PyTorch's
    `scaled_dot_product_attention`, GELU MLP of 256), a final RMS norm, all in float16 as
    memwise's `mixed_float16` stores them, and the logits dense layer in float32 (its `#[f32]`),
    with sparse cross-entropy. Its weights are random: only the saved tensors' sizes are
    compared."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h, heads, vocab = 64, 4, 256

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h, eps=1e-5), nn.LayerNorm(h, eps=1e-5)
            self.qkv, self.out = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc, self.proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            b = x.shape[0]
            q, k, v = self.qkv(self.ln_1(x)).view(b, seq, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, seq, h))
            return x + self.proj(F.gelu(self.fc(self.ln_2(x))))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.wpe = nn.Embedding(vocab, h), nn.Parameter(torch.randn(seq, h))
            self.blocks = nn.ModuleList([Block(), Block()])
            self.ln_f = nn.RMSNorm(h, eps=1e-5)

        def forward(self, ids):
            x = self.embed(ids) + self.wpe
            for blk in self.blocks:
                x = blk(x)
            return self.ln_f(x)

    torch.manual_seed(0)
    net = Gpt().half()
    logits = nn.Linear(h, vocab)
    params = {p.untyped_storage().data_ptr() for m in (net, logits) for p in m.parameters()}
    ids = torch.randint(0, vocab, (batch, seq))
    target = torch.randint(0, vocab, (batch, seq))
    saved: dict[int, tuple[int, str]] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved.setdefault(s.data_ptr(), (s.nbytes(), f"{tuple(t.shape)} {t.dtype}"))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = logits(net(ids).float())
        loss = F.cross_entropy(y.view(-1, vocab), target.view(-1))
    loss.backward()
    return {f"{desc} #{i}": n for i, (n, desc) in enumerate(saved.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["mnist_mlp", "vae", "convnet", "gpt"],
                    choices=["mnist_mlp", "vae", "convnet", "gpt"])
    ap.add_argument("--no-build", action="store_true", help="use the examples already built")
    ap.add_argument("--markdown", action="store_true", help="print a table for docs/BENCHMARKS.md")
    ap.add_argument("--verbose", action="store_true", help="list every kept tensor")
    a = ap.parse_args(argv)
    if not a.no_build:
        compare.build(["user_models" if m == "gpt" else m for m in a.models])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in a.models:
            plan_path = work / f"{model}.plan.json"
            if model == "gpt":
                exe = compare.target_dir() / "release" / "examples" / "user_models"
                cmd = [str(exe), "--model", "gpt", "--device", "cpu", "--steps", "1",
                       "--plan-json", str(plan_path)]
            else:
                exe = compare.target_dir() / "release" / "examples" / model
                cmd = [str(exe), "--device", "cpu", "--no-shuffle", "--steps", "1",
                       "--plan-json", str(plan_path),
                       "--save-initial-weights", str(work / f"{model}.init.safetensors"),
                       "--dump-batches", str(work / f"{model}.batches.safetensors")]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")
            plan = json.loads(plan_path.read_text())
            mine = memwise_kept(plan)
            theirs = torch_gpt_kept() if model == "gpt" else torch_kept(model, work)
            if a.verbose:
                for name, n in sorted(mine.items(), key=lambda kv: -kv[1]):
                    print(f"  memwise {model:10} {n:>12,}  {name}")
                for name, n in sorted(theirs.items(), key=lambda kv: -kv[1]):
                    print(f"  torch   {model:10} {n:>12,}  {name}")
            m, t = sum(mine.values()), sum(theirs.values())
            rows.append((model, plan["batch"], m, len(mine), t, len(theirs), m / t))
    if a.markdown:
        print("| model | batch | memwise kept | tensors | PyTorch saved | storages | memwise / PyTorch |")
        print("|---|--:|--:|--:|--:|--:|--:|")
        for model, b, m, mn, t, tn, ratio in rows:
            print(f"| {model} | {b} | {m:,} B | {mn} | {t:,} B | {tn} | {ratio:.3f} |")
    else:
        for model, b, m, mn, t, tn, ratio in rows:
            print(f"{model:10} batch {b:4}  memwise {m:>12,} B ({mn:3} tensors)  "
                  f"PyTorch {t:>12,} B ({tn:3} storages)  ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
