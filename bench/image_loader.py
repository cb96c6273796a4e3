#!/usr/bin/env python3
"""Image-folder loader throughput, side by side on the same folder: images per second decoded
and resized to 180×180×3, batches of 32, a shuffled full pass (the best of --passes):

- memwise's ImageFolder (examples/image_loader_bench.rs), 1 and 2 worker threads (0: in the
  calling thread);
- torchvision.datasets.ImageFolder (PIL decode, transforms.Resize((180, 180)) — bilinear with
  antialiasing, as memwise — and PILToTensor, so it stays uint8) with a DataLoader of
  num_workers 0, 1, 2;
- tf.keras.utils.image_dataset_from_directory (tf.data, AUTOTUNE parallelism; bilinear
  resize, float32 out), when a Python with TensorFlow is given (--tf-python).

Folders: --folder DIR, or --make-photos DIR (writes N JPEG "photos" at Kaggle cats-vs-dogs
sizes, 300–500 px a side, from random crops of the colour photos scikit-image ships) and/or
--make-digits DIR (the bundled MNIST digits 0 and 1 as 28×28 PNG/JPEG files, as the
cats_vs_dogs example writes them). Beside images per second (wall clock), images per
CPU-second (user + system time of the loader's process, threads and worker processes): on a
machine shared with other work the first depends on how much of the CPU each loader gets,
the second much less.

    bash bench/setup.sh
    bench/.venv/bin/python bench/image_loader.py --make-photos /tmp/photos --make-digits /tmp/digits \
        --tf-python /path/to/python-with-tensorflow --markdown
"""
import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def make_photos(out, n, seed=1):
    """N JPEGs in two class folders from random crops of scikit-image's colour photos."""
    import numpy as np
    import skimage
    from PIL import Image

    data = os.path.join(os.path.dirname(skimage.__file__), "data")
    classes = {
        "cat": ["chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg"],
        "dog": ["motorcycle_left.png", "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "ihc.png"],
    }
    rng = random.Random(seed)
    sources = {c: [Image.open(os.path.join(data, f)).convert("RGB") for f in fs] for c, fs in classes.items()}
    for c in classes:
        os.makedirs(os.path.join(out, c), exist_ok=True)
    for i in range(n):
        c = "cat" if i % 2 == 0 else "dog"
        src = rng.choice(sources[c])
        w, h = src.size
        cw, ch = int(w * rng.uniform(0.5, 1.0)), int(h * rng.uniform(0.5, 1.0))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        size = (rng.randint(300, 500), rng.randint(250, 500))
        img = src.crop((x, y, x + cw, y + ch)).resize(size, Image.BICUBIC)
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        img.save(os.path.join(out, c, f"{c}.{i // 2}.jpg"), quality=90)
    return out


def folder_stats(folder):
    files = [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs]
    size = sum(os.path.getsize(f) for f in files)
    return len(files), size


def bench_torch(folder, workers, passes, batch, size):
    import torch
    from torchvision import datasets, transforms

    ds = datasets.ImageFolder(folder, transform=transforms.Compose(
        [transforms.Resize((size, size)), transforms.PILToTensor()]))
    best, best_cpu = float("inf"), float("inf")
    for p in range(passes):
        g = torch.Generator().manual_seed(p)
        dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                         drop_last=True, generator=g)
        t0, c0 = time.perf_counter(), cpu_seconds()
        n = 0
        for x, _ in dl:
            assert x.dtype == torch.uint8 and x.shape[1:] == (3, size, size)
            n += x.shape[0]
        del dl  # its worker processes exit and are waited for: their CPU time is counted
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, cpu_seconds() - c0)
    return {"loader": "torchvision ImageFolder + DataLoader", "workers": workers, "images": n,
            "images_per_s": n / best, "images_per_cpu_s": n / best_cpu, "torch": torch.__version__}


def cpu_seconds():
    """User + system CPU seconds of this process and its waited-for children."""
    import resource
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


TF_SNIPPET = r"""
import json, sys, time, os, resource
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
folder, passes, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
best, best_cpu = float("inf"), float("inf")
for p in range(passes):
    ds = tf.keras.utils.image_dataset_from_directory(folder, image_size=(size, size), batch_size=batch,
                                                     shuffle=True, seed=p, verbose=False)
    t0, c0 = time.perf_counter(), cpu(); n = 0
    for x, _ in ds:
        n += int(x.shape[0]) if int(x.shape[0]) == batch else 0
    best = min(best, time.perf_counter() - t0)
    best_cpu = min(best_cpu, cpu() - c0)
print(json.dumps({"loader": "tf.keras image_dataset_from_directory", "workers": "AUTOTUNE",
                  "images": n, "images_per_s": n / best, "images_per_cpu_s": n / best_cpu,
                  "tensorflow": tf.__version__}))
"""


def bench_tf(python, folder, passes, batch, size):
    out = subprocess.run([python, "-c", TF_SNIPPET, folder, str(passes), str(batch), str(size)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_memwise(binary, folder, workers, passes, batch, size):
    out = subprocess.run([binary, "--data", folder, "--workers", ",".join(map(str, workers)),
                          "--passes", str(passes), "--batch", str(batch), "--size", str(size)],
                         check=True, capture_output=True, text=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", action="append", default=[], help="an image folder to measure (repeatable)")
    ap.add_argument("--make-photos", metavar="DIR", help="write the photo folder there and measure it")
    ap.add_argument("--photos", type=int, default=2000, help="images in --make-photos (default 2000)")
    ap.add_argument("--make-digits", metavar="DIR", help="write the bundled digits 0/1 there and measure it")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=180)
    ap.add_argument("--tf-python", help="a Python interpreter with TensorFlow, for the Keras loader")
    ap.add_argument("--no-build", action="store_true", help="use the example binary already built")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    binary = os.path.join(target, "release", "examples", "image_loader_bench")
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "--example", "image_loader_bench"], cwd=ROOT, check=True)
    folders = list(a.folder)
    if a.make_photos:
        folders.append(make_photos(a.make_photos, a.photos))
    if a.make_digits:
        subprocess.run([binary, "--write-digits", a.make_digits, "--workers", "0", "--passes", "1"],
                       check=True, capture_output=True)
        folders.append(a.make_digits)
    rows = []
    for f in folders:
        files, size = folder_stats(f)
        results = bench_memwise(binary, f, [1, 2], a.passes, a.batch, a.size)
        results += [bench_torch(f, w, a.passes, a.batch, a.size) for w in (0, 1, 2)]
        if a.tf_python:
            try:
                results.append(bench_tf(a.tf_python, f, a.passes, a.batch, a.size))
            except subprocess.CalledProcessError as e:
                print(f"keras loader failed: {e.stderr[-400:]}", file=sys.stderr)
        fastest_other = max(r["images_per_s"] for r in results if r["loader"] != "memwise")
        for r in results:
            r["folder"] = f"{os.path.basename(f.rstrip('/'))} ({files} files, {size / files / 1024:.1f} KiB each)"
            r["vs_fastest_other"] = r["images_per_s"] / fastest_other
            rows.append(r)
            print(json.dumps(r), file=sys.stderr)
    if a.markdown:
        print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
              f"load average {os.getloadavg()[0]:.1f} at the end")
        print()
        print("| folder | loader | workers | images/s | × fastest of PyTorch/Keras | images per CPU-second "
              "| memwise RSS growth / estimate |")
        print("|---|---|--:|--:|--:|--:|--:|")
        for r in rows:
            mem = ""
            if r["loader"] == "memwise":
                mem = (f"{r['peak_rss_growth_bytes'] / 2**20:.2f} / {r['estimate_bytes'] / 2**20:.2f} MiB "
                       f"({r['estimate_error_percent']:+.1f} %)")
            print(f"| {r['folder']} | {r['loader']} | {r['workers']} | {r['images_per_s']:.0f} | "
                  f"{r['vs_fastest_other']:.2f} | {r['images_per_cpu_s']:.0f} | {mem} |")


if __name__ == "__main__":
    main()
