#!/usr/bin/env python3
"""PyTorch eager baselines for scripts/gpu-check.sh, on the same GPU: the models gpu_check
trains (mnist_mlp, the small convnet, the conv VAE), same batch sizes, synthetic data.
Prints, per model, samples/s (after warm-up) and torch.cuda.max_memory_allocated over model
build + training steps.

usage: torch_bench.py [--steps N]   (env GPU_CHECK_*_BATCH as for gpu_check)
"""
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 100
dev = torch.device("cuda")


def env(name, default):
    return int(os.environ.get(name, default))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(784, 512)
        self.logits = nn.Linear(512, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.logits(F.relu(self.hidden(x))), y)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32, eps=1e-3, momentum=0.01)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.probs = nn.Linear(64, 10)

    def forward(self, x, y):
        h = F.max_pool2d(self.bn1(F.relu(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        h = self.drop(h.mean(dim=(2, 3)))
        return F.cross_entropy(self.probs(h), y)


class Vae(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 32, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.d = nn.Linear(7 * 7 * 64, 16)
        self.mean = nn.Linear(16, 2)
        self.logvar = nn.Linear(16, 2)
        self.dd = nn.Linear(2, 7 * 7 * 64)
        self.t1 = nn.ConvTranspose2d(64, 64, 3, stride=2, padding=1, output_padding=1)
        self.t2 = nn.ConvTranspose2d(64, 32, 3, stride=2, padding=1, output_padding=1)
        self.t3 = nn.ConvTranspose2d(32, 1, 3, stride=1, padding=1)

    def forward(self, x, _y):
        h = F.relu(self.d(F.relu(self.c2(F.relu(self.c1(x)))).flatten(1)))
        m, lv = self.mean(h), self.logvar(h)
        z = m + torch.exp(0.5 * lv) * torch.randn_like(m)
        h = F.relu(self.dd(z)).view(-1, 64, 7, 7)
        out = torch.sigmoid(self.t3(F.relu(self.t2(F.relu(self.t1(h))))))
        bce = F.binary_cross_entropy(out, x, reduction="sum") / x.shape[0]
        kl = (-0.5 * (1 + lv - m * m - lv.exp())).sum() / x.shape[0]
        return bce + kl


def bench(name, make, opt, batch, x_shape):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = make().to(dev)
    o = opt(model.parameters())
    x = torch.rand((batch, *x_shape), device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)

    def step():
        o.zero_grad(set_to_none=True)
        model(x, y).backward()
        o.step()

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    sps = steps * batch / (time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() - base
    print(f"torch {name:<10} batch {batch:<4} {sps:12.0f} samples/s   max_memory_allocated {peak / 2**20:.2f} MiB")


rms = lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9, eps=1e-7)
adam = lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-7)
print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}")
bench("mnist_mlp", Mlp, rms, env("GPU_CHECK_MLP_BATCH", 128), (784,))
bench("convnet", ConvNet, rms, env("GPU_CHECK_CONV_BATCH", 64), (1, 28, 28))
bench("vae", Vae, adam, env("GPU_CHECK_VAE_BATCH", 128), (1, 28, 28))
