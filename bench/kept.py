"""What one training step keeps from its forward pass for its backward pass: memwise against
PyTorch, model by model (docs/BENCHMARKS.md, "Kept for backward against PyTorch").

memwise: the model's plan (an example's ``--plan-json``, or ``planner/examples/zoo_plan_json.rs``
for a zoo model no example trains); every activation or input tensor the forward pass leaves
alive for the loss and backward steps (alive across the first loss step), at its exact size
(elements × dtype, no arena alignment). Tensors a checkpointed segment drops and recomputes
are not alive there, and are not counted.

PyTorch: the twin of the same model runs one training step under
``torch.autograd.graph.saved_tensors_hooks``; every tensor autograd saves is counted once per
storage, by the storage's bytes, parameters (and the new twins' batch-norm running statistics,
persistent state that memwise does not count as activations either) excluded. The twins pad
explicitly where TensorFlow's "same" padding is asymmetric; a saved padded copy is counted as
the tensor it pads, which is what PyTorch's own (symmetric) padding would keep. A segment the
memwise model checkpoints runs under ``torch.utils.checkpoint`` (non-reentrant) in the twin;
the inputs the checkpoint holds for its recompute are counted as saved, since they are kept for
the backward as surely as a saved tensor is.

    bash bench/setup.sh                      # once
    bench/.venv/bin/python bench/kept.py [--models mnist_mlp vae ...] [--markdown] [--verbose]

The models:

- ``mnist_mlp``, ``vae``, ``convnet``: the examples of the same names against their twins of
  bench/twins.py (same batch and dtypes, the initial weights memwise wrote).
- ``gpt``: `examples/user_models.rs`'s two-block mixed-float16 TinyGpt (sequence 32), against a
  float16 twin written here (``torch_gpt_kept``).
- ``unet``: `examples/user_models.rs`'s SmallUnet (batch 16, 32×32×3 u8 images), whose two
  bottom convolutions are one ``#[checkpoint]`` segment; the twin checkpoints the same two.
- ``resnet50``: the planner zoo's ResNet-50 (v1 bottlenecks, float32) at batch 2.
- ``separable_resnet``: `examples/user_models.rs`'s SeparableResNet (batch 32) under
  ``checkpoint = auto``, its twin checkpointing what the plan checkpoints.

The last three twins have random weights: kept bytes do not depend on values. Each is checked
against the plan's recompute steps, so a plan that checkpoints other layers than the twin
stops the run instead of comparing unlike with unlike.
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

# The models of `examples/user_models.rs` (its `--model` value) and of the planner's zoo.
USER_MODELS = {"gpt": "gpt", "unet": "unet", "separable_resnet": "resnet"}
ZOO_MODELS = {"resnet50": ("resnet50", 2)}
MODELS = ["mnist_mlp", "vae", "convnet", "gpt", "unet", "resnet50", "separable_resnet"]

# The checkpoint segments of each twin, as memwise layer names. `checked_segments` holds them
# against the plan: every layer the plan recomputes must lie in one of them and every one of
# them must be recomputed in part (a segment's last layer is not: its output is the segment's
# output, which stays). `separable_resnet`'s `checkpoint = auto` chooses none at its 96 MiB
# budget (its step plans to about 70 MiB).
SEGMENTS = {"unet": [["bottom_1", "bottom_2"]], "separable_resnet": [], "resnet50": []}


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


def checked_segments(model: str, plan: dict) -> list[list[str]]:
    """The twin's checkpoint segments (``SEGMENTS``), after checking that the plan recomputes
    exactly within them. An input's recomputed cast (a u8 input kept as u8, its float copy
    remade for the first layer's backward) is no checkpoint and is left out."""
    segments = SEGMENTS.get(model, [])
    recomputed = {s["layer"] for s in plan["steps"]
                  if s["phase"] == "recompute" and s["op"] != "input_cast"}
    inside = {layer for seg in segments for layer in seg}
    stray = recomputed - inside
    missing = [seg for seg in segments if not recomputed & set(seg)]
    if stray or missing:
        sys.exit(f"{model}: the plan recomputes {sorted(recomputed)}, the twin checkpoints "
                 f"{segments}: update SEGMENTS and the twin in bench/kept.py")
    return segments


class SavedTensors:
    """What autograd keeps for backward inside a ``with`` block, once per storage.

    ``exclude``: storages not to count (parameters, running statistics). A saved copy padded
    by ``torch.nn.functional.pad`` is counted as the tensor it pads (see the module's
    docstring). ``checkpoint`` runs a segment under non-reentrant ``torch.utils.checkpoint``
    and counts the inputs it holds for the recompute, which no saved-tensor hook sees."""

    def __init__(self, exclude):
        import torch

        self.torch = torch
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.saved: dict[int, tuple[int, str]] = {}
        # storage -> (padded copy, the tensor it pads); holding the copy keeps its address
        # from being reused by a later tensor while the block runs.
        self.padded_from: dict[int, tuple] = {}

    def record(self, t):
        counted = self.padded_from.get(t.untyped_storage().data_ptr(), (t, t))[1]
        s = counted.untyped_storage()
        if s.data_ptr() not in self.exclude:
            self.saved.setdefault(s.data_ptr(), (s.nbytes(), f"{tuple(counted.shape)} {counted.dtype}"))
        return t

    def checkpoint(self, fn, *args):
        for a in args:
            self.record(a)
        return self.torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    def __enter__(self):
        functional = self.torch.nn.functional
        self.pad = functional.pad

        def pad_and_remember(x, *args, **kwargs):
            y = self.pad(x, *args, **kwargs)
            self.padded_from[y.untyped_storage().data_ptr()] = (y, x)
            return y

        functional.pad = pad_and_remember
        self.hooks = self.torch.autograd.graph.saved_tensors_hooks(self.record, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self.torch.nn.functional.pad = self.pad
        return False

    def kept(self) -> dict[str, int]:
        return {f"{desc} #{i}": n for i, (n, desc) in enumerate(self.saved.values())}


def torch_kept(model: str, work: Path) -> dict[str, int]:
    """Bytes of each storage a bench/twins.py twin's autograd saves in one step, parameters
    excluded."""
    import torch
    from safetensors import safe_open
    from safetensors.numpy import load_file

    weights = load_file(str(work / f"{model}.init.safetensors"))
    with safe_open(str(work / f"{model}.batches.safetensors"), "np") as f:
        meta = f.metadata()
        batches = {k: f.get_tensor(k) for k in f.keys()}
    net, train_step = twins.make_twin(model, weights, meta, torch.get_num_threads())
    inputs = {k: torch.from_numpy(v[0]) for k, v in batches.items()}
    with SavedTensors(net.parameters()) as saved:
        train_step(inputs, 0)
    return saved.kept()


def torch_gpt_kept(batch: int = 32, seq: int = 32) -> dict[str, int]:
    """The same for a twin of `examples/user_models.rs`'s TinyGpt: token and learned position
    embeddings, two pre-norm blocks (LayerNorm, causal 4-head attention through PyTorch's
    `scaled_dot_product_attention`, GELU MLP of 256), a final RMS norm, all in float16 as
    memwise's `mixed_float16` stores them, and the logits dense layer in float32 (its `#[f32]`),
    with sparse cross-entropy. Its weights are random: only the saved tensors' sizes are
    compared."""
    import torch
    import torch.nn.functional as F
    from torch import nn

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
    ids = torch.randint(0, vocab, (batch, seq))
    target = torch.randint(0, vocab, (batch, seq))
    with SavedTensors([*net.parameters(), *logits.parameters()]) as saved:
        y = logits(net(ids).float())
        loss = F.cross_entropy(y.view(-1, vocab), target.view(-1))
    loss.backward()
    return saved.kept()


def _run_twin(net, step, segments: list[list[str]]) -> dict[str, int]:
    """One training step of a random-weight twin (``step(saved, segments)`` returns the loss),
    counting what its autograd saves; parameters and buffers excluded."""
    with SavedTensors([*net.parameters(), *net.buffers()]) as saved:
        loss = step(saved, segments)
        loss.backward()
    return saved.kept()


def _run_classifier(net, image_hwc: tuple[int, int, int], classes: int, batch: int,
                    segments: list[list[str]]) -> dict[str, int]:
    """`_run_twin` of an image classifier on a batch of random u8 NHWC images and labels."""
    import torch
    import torch.nn.functional as F

    image = torch.randint(0, 256, (batch, *image_hwc), dtype=torch.uint8)
    label = torch.randint(0, classes, (batch,), dtype=torch.int32)
    return _run_twin(net, lambda saved, seg: F.cross_entropy(net(image), label.long()), segments)


def _nchw_unit(image):
    """u8 NHWC images as the float NCHW batch scaled by 1/255 that the twins' convolutions take."""
    return image.permute(0, 3, 1, 2).float().mul_(1.0 / 255.0)


def torch_unet_kept(segments: list[list[str]], batch: int = 16) -> dict[str, int]:
    """A twin of `examples/user_models.rs`'s SmallUnet, float32: 32×32×3 u8 images scaled by
    1/255; 3×3 "same" relu convolutions down_1 (16) → 2×2 max pool → down_2 (32) → max pool →
    bottom_1, bottom_2 (64, the ``#[checkpoint]`` segment) → up_2, a 3×3/2 "same" transposed
    relu convolution (32; TensorFlow crops the full output's last row and column) → concat
    (up_2, down_2) → merge_2 (32) → up_1 (16) → concat (up_1, down_1) → merge_1 (16) → the 1×1
    logits `mask`, with binary cross-entropy from logits against a float32 target."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if segments not in ([], [["bottom_1", "bottom_2"]]):
        sys.exit(f"unet: the twin checkpoints bottom_1..bottom_2 or nothing, not {segments}")

    def conv(i, o, k=3):  # stride 1, odd k: TensorFlow's "same" pads k // 2 on each side
        return nn.Conv2d(i, o, k, padding=k // 2)

    class SmallUnet(nn.Module):
        def __init__(self):
            super().__init__()
            self.down_1, self.down_2 = conv(3, 16), conv(16, 32)
            self.bottom_1, self.bottom_2 = conv(32, 64), conv(64, 64)
            self.up_2, self.up_1 = nn.ConvTranspose2d(64, 32, 3, 2), nn.ConvTranspose2d(32, 16, 3, 2)
            self.merge_2, self.merge_1 = conv(64, 32), conv(32, 16)
            self.mask = conv(16, 1, 1)

        def bottom(self, x):
            return F.relu(self.bottom_2(F.relu(self.bottom_1(x))))

        def forward(self, saved, image, segments):
            x = _nchw_unit(image)
            down_1 = F.relu(self.down_1(x))
            down_2 = F.relu(self.down_2(F.max_pool2d(down_1, 2)))
            x = F.max_pool2d(down_2, 2)
            x = saved.checkpoint(self.bottom, x) if segments else self.bottom(x)
            n = x.shape[2] * 2
            up_2 = F.relu(self.up_2(x)[:, :, :n, :n])
            x = F.relu(self.merge_2(torch.cat([up_2, down_2], dim=1)))
            up_1 = F.relu(self.up_1(x)[:, :, : 2 * n, : 2 * n])
            return self.mask(F.relu(self.merge_1(torch.cat([up_1, down_1], dim=1))))

    torch.manual_seed(0)
    net = SmallUnet()
    image = torch.randint(0, 256, (batch, 32, 32, 3), dtype=torch.uint8)
    target = torch.rand(batch, 32, 32, 1)

    def step(saved, segments):
        logits = net(saved, image, segments)
        return F.binary_cross_entropy_with_logits(logits, target.permute(0, 3, 1, 2))

    return _run_twin(net, step, segments)


def torch_resnet50_kept(segments: list[list[str]], batch: int = 2) -> dict[str, int]:
    """A twin of the planner zoo's `resnet50` (planner/src/zoo.rs), float32: 224×224×3 u8
    pixels scaled by 1/255; conv 7×7/2 → batch norm → relu → 3×3/2 max pool, all TensorFlow
    "same"; bottleneck v1 stages of 3, 4, 6, 3 blocks (the stride on the first 1×1 convolution
    and on the projection, not on the 3×3 as torchvision's v1.5 has it, which would keep the
    3×3's input at twice the resolution); batch norms with ε 1e-5; relu after each block's
    add; global average pool → dense 1000 → sparse cross-entropy (PyTorch's, on the logits)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if segments:
        sys.exit(f"resnet50: the twin checkpoints nothing, not {segments}")

    def conv_bn(i, o, k, s=1):
        return nn.ModuleDict({"conv": nn.Conv2d(i, o, k, s, bias=False), "bn": nn.BatchNorm2d(o, eps=1e-5)})

    def apply(m, x, k, s=1):
        return m["bn"](m["conv"](twins.tf_pad(x, k, s)))

    class Bottleneck(nn.Module):
        def __init__(self, cin, filters, stride, project):
            super().__init__()
            self.stride = stride
            self.proj = conv_bn(cin, 4 * filters, 1, stride) if project else None
            self.c1 = conv_bn(cin, filters, 1, stride)
            self.c2 = conv_bn(filters, filters, 3)
            self.c3 = conv_bn(filters, 4 * filters, 1)

        def forward(self, x):
            shortcut = apply(self.proj, x, 1, self.stride) if self.proj is not None else x
            h = F.relu(apply(self.c1, x, 1, self.stride))
            h = F.relu(apply(self.c2, h, 3))
            return F.relu(shortcut + apply(self.c3, h, 1))

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = conv_bn(3, 64, 7, 2)
            blocks, cin = [], 64
            for stage, (n, filters) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
                for b in range(n):
                    stride = 2 if stage > 0 and b == 0 else 1
                    blocks.append(Bottleneck(cin, filters, stride, b == 0))
                    cin = 4 * filters
            self.blocks = nn.ModuleList(blocks)
            self.predictions = nn.Linear(cin, 1000)

        def forward(self, pixels):
            x = F.relu(apply(self.conv1, _nchw_unit(pixels), 7, 2))
            x = F.max_pool2d(twins.tf_pad(x, 3, 2, float("-inf")), 3, 2)
            for blk in self.blocks:
                x = blk(x)
            return self.predictions(x.mean(dim=(2, 3)))

    torch.manual_seed(0)
    return _run_classifier(ResNet50(), (224, 224, 3), 1000, batch, segments)


def torch_separable_resnet_kept(segments: list[list[str]], batch: int = 32) -> dict[str, int]:
    """A twin of `examples/user_models.rs`'s SeparableResNet, float32: 64×64×3 u8 images
    scaled by 1/255; stem conv 3×3/2 (32, no bias, TensorFlow "same": pads 0 before and 1
    after); three stages of 64, 128, 256 filters, each batch norm (Keras's ε 1e-3) → relu →
    separable conv (depthwise 3×3, pointwise, no bias) → separable conv (pointwise bias) →
    relu → 3×3/2 "same" max pool, plus a 1×1/2 shortcut convolution of the stage's input, and
    their sum; global average pool → dense 10 → sparse cross-entropy (PyTorch's, on the
    logits, where memwise fuses the softmax into it)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if segments:
        sys.exit(f"separable_resnet: the twin checkpoints nothing, not {segments}")

    class Stage(nn.Module):
        def __init__(self, cin, size):
            super().__init__()
            self.bn = nn.BatchNorm2d(cin, eps=1e-3, momentum=0.01)
            self.dw_1 = nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False)
            self.pw_1 = nn.Conv2d(cin, size, 1, bias=False)
            self.dw_2 = nn.Conv2d(size, size, 3, padding=1, groups=size, bias=False)
            self.pw_2 = nn.Conv2d(size, size, 1)
            self.shortcut = nn.Conv2d(cin, size, 1, 2, bias=False)

        def forward(self, x):
            h = self.pw_1(self.dw_1(F.relu(self.bn(x))))
            h = F.relu(self.pw_2(self.dw_2(h)))
            return F.max_pool2d(twins.tf_pad(h, 3, 2, float("-inf")), 3, 2) + self.shortcut(x)

    class SeparableResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 32, 3, 2, bias=False)
            self.stages = nn.Sequential(Stage(32, 64), Stage(64, 128), Stage(128, 256))
            self.probs = nn.Linear(256, 10)

        def forward(self, image):
            x = self.stages(self.stem(twins.tf_pad(_nchw_unit(image), 3, 2)))
            return self.probs(x.mean(dim=(2, 3)))

    torch.manual_seed(0)
    return _run_classifier(SeparableResNet(), (64, 64, 3), 10, batch, segments)


TWINS = {"unet": torch_unet_kept, "resnet50": torch_resnet50_kept,
         "separable_resnet": torch_separable_resnet_kept}


def build(models: list[str]) -> None:
    """Release builds of what `models` need: the facade's examples and, for a zoo model, the
    planner's `zoo_plan_json` (in `CARGO_TARGET_DIR` when set, as compare.py's)."""
    examples = sorted({"user_models" if m in USER_MODELS else m for m in models if m not in ZOO_MODELS})
    if examples:
        compare.build(examples)
    if any(m in ZOO_MODELS for m in models):
        cmd = ["cargo", "build", "--release", "-p", "memwise-plan", "--example", "zoo_plan_json"]
        print("+", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, cwd=ROOT, check=True)


def memwise_plan(model: str, work: Path) -> dict:
    """The model's plan JSON; for the bench/twins.py models also their initial weights and
    first batch, in `work`."""
    examples = compare.target_dir() / "release" / "examples"
    plan_path = work / f"{model}.plan.json"
    if model in ZOO_MODELS:
        name, batch = ZOO_MODELS[model]
        cmd = [str(examples / "zoo_plan_json"), name, str(batch)]
    elif model in USER_MODELS:
        cmd = [str(examples / "user_models"), "--model", USER_MODELS[model], "--device", "cpu",
               "--steps", "1", "--plan-json", str(plan_path)]
    else:
        cmd = [str(examples / model), "--device", "cpu", "--no-shuffle", "--steps", "1",
               "--plan-json", str(plan_path),
               "--save-initial-weights", str(work / f"{model}.init.safetensors"),
               "--dump-batches", str(work / f"{model}.batches.safetensors")]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    if model in ZOO_MODELS:
        plan_path.write_text(r.stdout)
    return json.loads(plan_path.read_text())


def pytorch_kept(model: str, plan: dict, work: Path) -> dict[str, int]:
    if model == "gpt":
        return torch_gpt_kept()
    if model in TWINS:
        return TWINS[model](checked_segments(model, plan), batch=plan["batch"])
    return torch_kept(model, work)


def print_breakdown(model: str, mine: dict[str, int], theirs: dict[str, int]) -> None:
    """Markdown lists of one model's kept tensors: memwise's by name, PyTorch's storages
    grouped by shape and dtype (autograd names none), largest first."""
    print(f"\n<details><summary>{model}: the kept tensors</summary>\n")
    print("| memwise tensor | bytes |")
    print("|---|--:|")
    for name, n in sorted(mine.items(), key=lambda kv: -kv[1]):
        print(f"| `{name}` | {n:,} |")
    groups: dict[str, list[int]] = {}
    for name, n in theirs.items():
        groups.setdefault(name.rsplit(" #", 1)[0], []).append(n)
    print("\n| PyTorch storage | count | bytes |")
    print("|---|--:|--:|")
    for desc, ns in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"| `{desc}` | {len(ns)} | {sum(ns):,} |")
    print("\n</details>")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--no-build", action="store_true", help="use the examples already built")
    ap.add_argument("--markdown", action="store_true",
                    help="print a table for docs/BENCHMARKS.md, then each model's tensors")
    ap.add_argument("--verbose", action="store_true", help="list every kept tensor")
    a = ap.parse_args(argv)
    if not a.no_build:
        build(a.models)
    rows, lists = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in a.models:
            plan = memwise_plan(model, work)
            mine = memwise_kept(plan)
            theirs = pytorch_kept(model, plan, work)
            lists.append((model, mine, theirs))
            if a.verbose:
                for name, n in sorted(mine.items(), key=lambda kv: -kv[1]):
                    print(f"  memwise {model:16} {n:>12,}  {name}")
                for name, n in sorted(theirs.items(), key=lambda kv: -kv[1]):
                    print(f"  torch   {model:16} {n:>12,}  {name}")
            m, t = sum(mine.values()), sum(theirs.values())
            rows.append((model, plan["batch"], m, len(mine), t, len(theirs), m / t))
    if a.markdown:
        print("| model | batch | memwise kept | tensors | PyTorch saved | storages | memwise / PyTorch |")
        print("|---|--:|--:|--:|--:|--:|--:|")
        for model, b, m, mn, t, tn, ratio in rows:
            print(f"| {model} | {b} | {m:,} B | {mn} | {t:,} B | {tn} | {ratio:.3f} |")
        for model, mine, theirs in lists:
            print_breakdown(model, mine, theirs)
    else:
        for model, b, m, mn, t, tn, ratio in rows:
            print(f"{model:16} batch {b:4}  memwise {m:>12,} B ({mn:3} tensors)  "
                  f"PyTorch {t:>12,} B ({tn:3} storages)  ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
