"""PyTorch twins of memwise's examples (mnist_mlp, vae, convnet, gpt), for bench/compare.py.

Each twin has the same layers, batch, loss and optimizer semantics as the memwise model, starts
from the initial weights memwise wrote (``--save-initial-weights``, Keras layouts, see
docs/WEIGHTS.md) and trains on the batches memwise dumped (``--no-shuffle --dump-batches``), so
the loss after every step can be compared number for number. What "the same" takes:

* **Layouts.** memwise is NHWC with Keras weight layouts; the twins run PyTorch's usual NCHW
  and transpose the weights once on load. The dense layer after the VAE's flatten (and the one
  before its reshape) have their rows / columns permuted from (h, w, c) to (c, h, w) order, so
  no activation is ever permuted at run time.
* **TensorFlow "same" padding.** For a stride-2 3×3 convolution on an even input TF pads 0
  before and 1 after (PyTorch's ``padding=1`` pads 1 on both sides, a different function): the
  twins pad explicitly (``F.pad``). A stride-2 "same" transposed convolution likewise crops the
  last row and column of the full output instead of the first. Max pooling pads with -inf.
* **Losses.** memwise (like Keras) takes the value of the cross-entropies from the probabilities
  clipped to ``[1e-7, 1 - 1e-7]`` and back-propagates the exact ``p - target`` to the logits of
  the fused softmax / sigmoid; the twins do exactly that (custom autograd functions).
* **Optimizers.** Keras semantics, which PyTorch's built-ins do not have: RMSprop with epsilon
  *inside* the square root (``p -= lr·g / sqrt(v + eps)``), Adam with the bias correction folded
  into the step size and epsilon added to the uncorrected ``sqrt(v)``
  (``p -= lr·sqrt(1-b2^t)/(1-b1^t) · m / (sqrt(v) + eps)``). Written with PyTorch's multi-tensor
  ``torch._foreach_*`` kernels, the ones ``torch.optim`` itself uses.
* **Randomness.** Dropout masks and the VAE's sampling noise come from memwise's counter-based
  Philox4x32-10 stream, reproduced here in numpy (kernels/src/random.rs documents the layout):
  ``key = [seed lo, seed hi]``, ``counter = [i / 4, step lo, step hi, layer]``, word ``i % 4``;
  uniform ``(w >> 8)·2^-24``; normals by Box–Muller on the word pairs (0, 1) and (2, 3).
  ``layer`` is the layer's index in the model's field order (the batches file lists them) and
  ``step`` counts training steps from 0.

``--precision f64`` / ``f64r`` run the twin in float64 (``f64r``: every layer's output rounded to
float32); they are diagnostics for the convnet's divergence (docs/BENCHMARKS.md), not what
compare.py times.

Usage (normally through bench/compare.py)::

    python bench/twins.py --model vae --weights vae.init.safetensors \
        --batches vae.batches.safetensors --steps 40 --report-json vae.torch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

# ---------------------------------------------------------------------------------------------
# Memory: the same measurement as memwise's MemoryMonitor (runtime/src/monitor.rs).


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    return _status_kib("VmRSS:") * 1024, _status_kib("VmHWM:") * 1024


def release_free_heap() -> None:
    """glibc's malloc_trim(0), as memwise's MemoryMonitor does before its baseline."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> bool:
    """Resets VmHWM to the current resident size (Linux: ``5`` to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Philox4x32-10, vectorised (uint64 arrays holding u32 values).

_MASK = np.uint64(0xFFFFFFFF)
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK for c in (c0, c1, c2, c3))
    for r in range(10):
        if r > 0:
            k0 = (k0 + _W0) & 0xFFFFFFFF
            k1 = (k1 + _W1) & 0xFFFFFFFF
        p0 = _M0 * c0
        p1 = _M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return c0, c1, c2, c3


def stream_blocks(seed: int, layer: int, step: int, n: int) -> np.ndarray:
    """The words of elements 0..n (rounded up to whole blocks of 4), shape [blocks, 4]."""
    blocks = (n + 3) // 4
    b = np.arange(blocks, dtype=np.uint64)
    w = philox4x32_10(b, step & 0xFFFFFFFF, (step >> 32) & 0xFFFFFFFF, layer, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    return np.stack([x.astype(np.uint32) for x in w], axis=1)


def _unit(w: np.ndarray) -> np.ndarray:
    return (w >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def philox_uniform(seed: int, layer: int, step: int, n: int) -> np.ndarray:
    return _unit(stream_blocks(seed, layer, step, n)).reshape(-1)[:n]


def philox_normal(seed: int, layer: int, step: int, n: int) -> np.ndarray:
    w = stream_blocks(seed, layer, step, n)
    out = np.empty(w.shape, dtype=np.float32)
    two_pi = np.float32(2.0) * np.float32(np.pi)
    for a, b in ((0, 1), (2, 3)):
        u1 = ((w[:, a] >> np.uint32(8)) + np.uint32(1)).astype(np.float32) * np.float32(1.0 / 16777216.0)
        r = np.sqrt(np.float32(-2.0) * np.log(u1))
        theta = two_pi * _unit(w[:, b])
        out[:, a] = r * np.cos(theta)
        out[:, b] = r * np.sin(theta)
    return out.reshape(-1)[:n]


# ---------------------------------------------------------------------------------------------
# PyTorch parts (imported lazily so the Philox helpers work without torch).

EPS = 1e-7  # Keras backend.epsilon(), the clip of probabilities before a log


def _torch():
    import torch

    return torch


def tf_pad(x, k: int, s: int, value: float = 0.0):
    """TensorFlow "same" padding of an NCHW tensor for window k, stride s."""
    import torch.nn.functional as F

    pads = []
    for size in (x.shape[3], x.shape[2]):
        out = -(-size // s)
        total = max((out - 1) * s + k - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads, value=value) if any(pads) else x


def make_twin(name: str, weights: dict, meta: dict, threads: int, precision: str = "f32",
              channels_last: bool = False):
    """The twin of memwise's example `name` and its training step.

    ``channels_last``: images and 4-d weights in PyTorch's channels-last memory format (NHWC
    in memory, as memwise lays them out), often PyTorch's faster CPU setting for convolutions;
    the shapes and the arithmetic are the same.

    ``precision``: ``"f32"`` is PyTorch's ordinary float32 path (the one compare.py times and
    compares). The others are diagnostics for the convnet's divergence (docs/BENCHMARKS.md,
    "Against PyTorch (CPU)"): ``"f64"`` computes every layer in float64 (near-exact arithmetic
    on the float32 parameters); ``"f64r"`` does too but rounds each layer's output, and on the
    way back the gradient reaching it, to float32 — every layer's result is then the correctly
    rounded value of its mathematical result on float32 inputs, so mathematically equal values
    (max-pool ties) are bit-identical whatever order the kernels sum in. In all three the
    parameters, their gradients and the optimizer state are float32.
    """
    torch = _torch()
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    f32 = np.float32
    if precision not in ("f32", "f64", "f64r"):
        raise ValueError(f"precision {precision!r}: f32, f64 or f64r")
    exact = precision == "f64r"
    dt = torch.float64 if precision != "f32" else torch.float32

    def rnd(x):
        """A layer's output rounded to float32 (f64r only), differentiably."""
        return x.to(torch.float32).to(dt) if exact else x

    def P(p):
        """A float32 parameter in the compute dtype (its gradient comes back float32)."""
        return p.to(dt)
    layers = json.loads(meta["memwise.layers"])
    seed = int(meta["memwise.seed"])
    scale = float(f32(1.0) / f32(255.0))

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).clone()

    def fixed(a):  # not trained, in the compute dtype (noise, masks, batch-norm running stats)
        return t(a).to(dt)

    def param(a):
        p = t(a)
        if channels_last and p.dim() == 4:
            p = p.contiguous(memory_format=torch.channels_last)
        return torch.nn.Parameter(p)

    def image(x):
        """An [n, c, h, w] input in the twin's memory format."""
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x

    def dense_w(w):  # Keras [in, out] -> Linear [out, in]
        return param(np.asarray(w).T)

    def conv_w(w):  # [kh, kw, c_in, c_out] -> [c_out, c_in, kh, kw]; also conv-transpose's
        return param(np.asarray(w).transpose(3, 2, 0, 1))

    def dw_w(w):  # depthwise [kh, kw, c, 1] -> [c, 1, kh, kw]
        kh, kw, c, m = w.shape
        return param(np.asarray(w).reshape(kh, kw, c * m).transpose(2, 0, 1)[:, None])

    class SoftmaxSparseXent(torch.autograd.Function):
        """Keras sparse categorical cross-entropy on the softmax of `logits` (value from the
        clipped probabilities), gradient (p - onehot)/n to the logits."""

        @staticmethod
        def forward(ctx, logits, labels):
            p = torch.softmax(logits, dim=1)
            lab = labels.long().view(-1, 1)
            loss = -torch.log(p.gather(1, lab).clamp(EPS, 1.0 - EPS)).mean()
            ctx.save_for_backward(p, lab)
            return loss

        @staticmethod
        def backward(ctx, g):
            p, lab = ctx.saved_tensors
            d = p.clone()
            d.scatter_add_(1, lab, torch.full_like(lab, -1, dtype=d.dtype))
            return d.mul_(g / p.shape[0]), None

    class SigmoidBceSum(torch.autograd.Function):
        """Keras binary cross-entropy of sigmoid(`logits`), summed over the features and
        averaged over the batch; gradient (p - t)/n to the logits."""

        @staticmethod
        def forward(ctx, logits, target):
            p = torch.sigmoid(logits)
            pc = p.clamp(EPS, 1.0 - EPS)
            el = -(target * torch.log(pc + EPS) + (1.0 - target) * torch.log(1.0 - pc + EPS))
            ctx.save_for_backward(p, target)
            return el.sum() / p.shape[0]

        @staticmethod
        def backward(ctx, g):
            p, target = ctx.saved_tensors
            return (p - target).mul_(g / p.shape[0]), None

    # ---- optimizers (Keras formulas, multi-tensor) -----------------------------------------

    class KerasRMSprop:
        def __init__(self, params, lr=1e-3, rho=0.9, eps=1e-7):
            self.params = list(params)
            self.v = [torch.zeros_like(p) for p in self.params]
            self.lr, self.rho, self.eps = f32(lr), f32(rho), f32(eps)

        @torch.no_grad()
        def step(self):
            g = [p.grad for p in self.params]
            torch._foreach_mul_(self.v, float(self.rho))
            torch._foreach_addcmul_(self.v, g, g, value=float(f32(1) - self.rho))
            den = torch._foreach_add(self.v, float(self.eps))
            torch._foreach_sqrt_(den)
            torch._foreach_addcdiv_(self.params, g, den, value=-float(self.lr))

    class KerasAdam:
        def __init__(self, params, lr=1e-3, b1=0.9, b2=0.999, eps=1e-7):
            self.params = list(params)
            self.m = [torch.zeros_like(p) for p in self.params]
            self.v = [torch.zeros_like(p) for p in self.params]
            self.lr, self.b1, self.b2, self.eps = f32(lr), f32(b1), f32(b2), f32(eps)
            self.t = 0

        @torch.no_grad()
        def step(self):
            self.t += 1
            g = [p.grad for p in self.params]
            alpha = f32(float(self.lr) * np.sqrt(1.0 - float(self.b2) ** self.t) / (1.0 - float(self.b1) ** self.t))
            torch._foreach_lerp_(self.m, g, float(f32(1) - self.b1))
            torch._foreach_lerp_(self.v, torch._foreach_mul(g, g), float(f32(1) - self.b2))
            den = torch._foreach_sqrt(self.v)
            torch._foreach_add_(den, float(self.eps))
            torch._foreach_addcdiv_(self.params, self.m, den, value=-float(alpha))

    # ---- models ----------------------------------------------------------------------------

    w = weights

    if name == "mnist_mlp":

        class MnistMlp(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.hidden_w, self.hidden_b = dense_w(w["hidden.weight"]), param(w["hidden.bias"])
                self.logits_w, self.logits_b = dense_w(w["logits.weight"]), param(w["logits.bias"])

            def forward(self, inputs, step):
                x = rnd(inputs["pixels"].to(dt).mul_(scale))
                h = F.relu(rnd(F.linear(x, P(self.hidden_w), P(self.hidden_b))))
                logits = rnd(F.linear(h, P(self.logits_w), P(self.logits_b)))
                return SoftmaxSparseXent.apply(logits, inputs["labels"])

        model = MnistMlp()
        opt = KerasRMSprop(model.parameters(), lr=1e-3)

    elif name == "vae":
        z_layer = layers.index("z")
        # enc_dense reads the NHWC flatten, i.e. rows in (h, w, c) order: reorder to (c, h, w).
        enc_dense = np.asarray(w["enc_dense.weight"]).reshape(7, 7, 64, 16).transpose(2, 0, 1, 3).reshape(3136, 16)
        # dec_dense's columns feed a reshape to [7, 7, 64] (h, w, c): reorder to (c, h, w).
        dec_dense = np.asarray(w["dec_dense.weight"]).reshape(2, 7, 7, 64).transpose(0, 3, 1, 2).reshape(2, 3136)
        dec_bias = np.asarray(w["dec_dense.bias"]).reshape(7, 7, 64).transpose(2, 0, 1).reshape(3136)

        class ConvVae(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.c1_w, self.c1_b = conv_w(w["enc_conv1.weight"]), param(w["enc_conv1.bias"])
                self.c2_w, self.c2_b = conv_w(w["enc_conv2.weight"]), param(w["enc_conv2.bias"])
                self.ed_w, self.ed_b = dense_w(enc_dense), param(w["enc_dense.bias"])
                self.zm_w, self.zm_b = dense_w(w["z_mean.weight"]), param(w["z_mean.bias"])
                self.zv_w, self.zv_b = dense_w(w["z_log_var.weight"]), param(w["z_log_var.bias"])
                self.dd_w, self.dd_b = dense_w(dec_dense), param(dec_bias)
                self.d1_w, self.d1_b = conv_w(w["dec_deconv1.weight"]), param(w["dec_deconv1.bias"])
                self.d2_w, self.d2_b = conv_w(w["dec_deconv2.weight"]), param(w["dec_deconv2.bias"])
                self.o_w, self.o_b = conv_w(w["decoded.weight"]), param(w["decoded.bias"])

            def forward(self, inputs, step):
                px = inputs["pixels"]  # [n, 28, 28, 1] u8 == NCHW [n, 1, 28, 28]
                n = px.shape[0]
                x = image(rnd(px.reshape(n, 1, 28, 28).to(dt).mul_(scale)))
                h = F.relu(rnd(F.conv2d(tf_pad(x, 3, 2), P(self.c1_w), P(self.c1_b), stride=2)))
                h = F.relu(rnd(F.conv2d(tf_pad(h, 3, 2), P(self.c2_w), P(self.c2_b), stride=2)))
                h = F.relu(rnd(F.linear(h.reshape(n, -1), P(self.ed_w), P(self.ed_b))))
                zm = rnd(F.linear(h, P(self.zm_w), P(self.zm_b)))
                zv = rnd(F.linear(h, P(self.zv_w), P(self.zv_b)))
                eps = fixed(philox_normal(seed, z_layer, step, n * 2)).view(n, 2)
                z = rnd(zm + torch.exp(0.5 * zv) * eps)
                d = F.relu(rnd(F.linear(z, P(self.dd_w), P(self.dd_b)))).view(n, 64, 7, 7)
                d = F.relu(rnd(F.conv_transpose2d(d, P(self.d1_w), P(self.d1_b), stride=2)[:, :, :14, :14]))
                d = F.relu(rnd(F.conv_transpose2d(d, P(self.d2_w), P(self.d2_b), stride=2)[:, :, :28, :28]))
                logits = rnd(F.conv_transpose2d(d, P(self.o_w), P(self.o_b), stride=1, padding=1))
                rec = SigmoidBceSum.apply(logits.reshape(n, -1), x.reshape(n, -1))
                kl = (-0.5 * (1.0 + zv - zm * zm - torch.exp(zv)).sum(dim=1)).mean()
                return rec + kl

        model = ConvVae()
        opt = KerasAdam(model.parameters())

    elif name == "convnet":
        drop_layer = layers.index("dropout")

        class Block(torch.nn.Module):
            def __init__(self, p):
                super().__init__()
                self.g1, self.b1 = param(w[p + "bn_1.weight"]), param(w[p + "bn_1.bias"])
                self.rm1, self.rv1 = fixed(w[p + "bn_1.running_mean"]), fixed(w[p + "bn_1.running_var"])
                self.dw1, self.pw1 = dw_w(w[p + "sep_1.depthwise_weight"]), conv_w(w[p + "sep_1.pointwise_weight"])
                self.g2, self.b2 = param(w[p + "bn_2.weight"]), param(w[p + "bn_2.bias"])
                self.rm2, self.rv2 = fixed(w[p + "bn_2.running_mean"]), fixed(w[p + "bn_2.running_var"])
                self.dw2, self.pw2 = dw_w(w[p + "sep_2.depthwise_weight"]), conv_w(w[p + "sep_2.pointwise_weight"])
                self.res = conv_w(w[p + "residual.weight"])

            def forward(self, x):
                h = F.relu(rnd(F.batch_norm(x, self.rm1, self.rv1, P(self.g1), P(self.b1), True, 0.01, 1e-3)))
                h = rnd(F.conv2d(h, P(self.dw1), padding=1, groups=h.shape[1]))
                h = rnd(F.conv2d(h, P(self.pw1)))
                h = F.relu(rnd(F.batch_norm(h, self.rm2, self.rv2, P(self.g2), P(self.b2), True, 0.01, 1e-3)))
                h = rnd(F.conv2d(h, P(self.dw2), padding=1, groups=h.shape[1]))
                h = rnd(F.conv2d(h, P(self.pw2)))
                h = F.max_pool2d(tf_pad(h, 3, 2, float("-inf")), 3, 2)
                return rnd(h + rnd(F.conv2d(x, P(self.res), stride=2)))

        class ConvNet(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.stem = conv_w(w["stem.weight"])
                self.blocks = torch.nn.ModuleList([Block(f"block_{s}.") for s in (32, 64, 128)])
                self.probs_w, self.probs_b = dense_w(w["probs.weight"]), param(w["probs.bias"])

            def forward(self, inputs, step):
                px = inputs["pixels"]
                n = px.shape[0]
                x = image(rnd(px.reshape(n, 1, 28, 28).to(dt).mul_(scale)))
                h = rnd(F.conv2d(x, P(self.stem)))
                for b in self.blocks:
                    h = b(h)
                h = rnd(h.mean(dim=(2, 3)))
                keep = philox_uniform(seed, drop_layer, step, h.numel()) >= np.float32(0.5)
                mask = fixed(keep.astype(np.float32) * np.float32(2.0)).view_as(h)
                logits = rnd(F.linear(h * mask, P(self.probs_w), P(self.probs_b)))
                return SoftmaxSparseXent.apply(logits, inputs["labels"])

        model = ConvNet()
        opt = KerasRMSprop(model.parameters(), lr=1e-3)
    elif name == "gpt":
        heads = 4

        class GptBlock(torch.nn.Module):
            def __init__(self, p):
                super().__init__()
                self.ln1_w, self.ln1_b = param(w[p + "ln_1.weight"]), param(w[p + "ln_1.bias"])
                self.qkv_w, self.qkv_b = dense_w(w[p + "attn.qkv.weight"]), param(w[p + "attn.qkv.bias"])
                self.out_w, self.out_b = dense_w(w[p + "attn.out.weight"]), param(w[p + "attn.out.bias"])
                self.ln2_w, self.ln2_b = param(w[p + "ln_2.weight"]), param(w[p + "ln_2.bias"])
                self.fc_w, self.fc_b = dense_w(w[p + "fc.weight"]), param(w[p + "fc.bias"])
                self.proj_w, self.proj_b = dense_w(w[p + "proj.weight"]), param(w[p + "proj.bias"])

            def forward(self, x):
                n, s, h = x.shape
                a = rnd(F.layer_norm(x, (h,), P(self.ln1_w), P(self.ln1_b), 1e-5))
                qkv = rnd(F.linear(a, P(self.qkv_w), P(self.qkv_b)))
                # memwise's packed qkv: q, k, v in column thirds, head i in columns i·d..(i+1)·d.
                q, k, v = (t.view(n, s, heads, h // heads).transpose(1, 2) for t in qkv.split(h, dim=2))
                ctx = rnd(F.scaled_dot_product_attention(q, k, v, is_causal=True))
                ctx = ctx.transpose(1, 2).reshape(n, s, h)
                x = rnd(x + rnd(F.linear(ctx, P(self.out_w), P(self.out_b))))
                m = rnd(F.layer_norm(x, (h,), P(self.ln2_w), P(self.ln2_b), 1e-5))
                m = rnd(F.gelu(rnd(F.linear(m, P(self.fc_w), P(self.fc_b)))))
                return rnd(x + rnd(F.linear(m, P(self.proj_w), P(self.proj_b))))

        class Gpt(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.positions = param(w["embed.weight"]), param(w["positions.weight"])
                self.blocks = torch.nn.ModuleList([GptBlock(f"blocks.{i}.") for i in range(2)])
                self.ln_w, self.ln_b = param(w["ln_f.weight"]), param(w["ln_f.bias"])
                self.logits_w, self.logits_b = dense_w(w["logits.weight"]), param(w["logits.bias"])

            def forward(self, inputs, step):
                ids = inputs["ids"].long()
                x = rnd(F.embedding(ids, P(self.embed)) + P(self.positions)[None])
                for b in self.blocks:
                    x = b(x)
                x = rnd(F.layer_norm(x, (x.shape[2],), P(self.ln_w), P(self.ln_b), 1e-5))
                logits = rnd(F.linear(x, P(self.logits_w), P(self.logits_b)))
                return SoftmaxSparseXent.apply(logits.reshape(-1, logits.shape[2]), inputs["next"].reshape(-1))

        model = Gpt()
        opt = KerasAdam(model.parameters())
    else:
        raise SystemExit(f"unknown model {name!r}: mnist_mlp, vae, convnet or gpt")

    def train_step(inputs, step):
        for p in opt.params:
            p.grad = None
        loss = model(inputs, step)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return model, train_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, choices=["mnist_mlp", "vae", "convnet", "gpt"])
    ap.add_argument("--weights", required=True, help="initial weights memwise wrote")
    ap.add_argument("--batches", required=True, help="batches memwise dumped")
    ap.add_argument("--steps", type=int, default=40, help="training steps (batches are reused cyclically)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--precision", choices=["f32", "f64", "f64r"], default="f32",
                    help="f32: PyTorch's float32 path (default); f64: every layer in float64; "
                         "f64r: every layer in float64, its output rounded to float32 "
                         "(diagnostics, see make_twin)")
    ap.add_argument("--channels-last", action="store_true",
                    help="images and 4-d weights in channels-last memory format (see make_twin)")
    ap.add_argument("--report-json", help="write losses, step times and memory here")
    a = ap.parse_args(argv)

    torch = _torch()
    from safetensors import safe_open
    from safetensors.numpy import load_file

    torch.set_num_threads(a.threads)
    weights = load_file(a.weights)
    with safe_open(a.batches, "np") as f:
        meta = f.metadata()
        batches = {k: f.get_tensor(k) for k in f.keys()}
    dumped = int(meta["memwise.steps"])
    # Baseline: data loaded, model not built (as memwise's examples take theirs): free heap
    # handed back, peak reset, then the resident size.
    release_free_heap()
    reset_peak()
    base, _ = rss_bytes()
    model, train_step = make_twin(a.model, weights, meta, a.threads, a.precision, a.channels_last)
    losses, times = [], []
    for s in range(a.steps):
        inputs = {k: torch.from_numpy(v[s % dumped]) for k, v in batches.items()}
        t0 = time.perf_counter()
        losses.append(train_step(inputs, s))
        times.append((time.perf_counter() - t0) * 1e3)
    cur, peak = rss_bytes()
    batch = int(meta["memwise.batch"])
    med = statistics.median(times)
    report = {
        "schema": "memwise.bench.torch/1",
        "model": a.model,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "precision": a.precision,
        "channels_last": a.channels_last,
        "batch": batch,
        "steps": a.steps,
        "measured": {
            "peak_rss_growth_bytes": peak - base,
            "step_ms_median": med,
            "samples_per_s": batch / (med / 1e3),
        },
        "loss": losses,
        "step_ms": times,
    }
    if a.report_json:
        with open(a.report_json, "w") as f:
            json.dump(report, f, indent=1)
    else:
        json.dump(report, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
