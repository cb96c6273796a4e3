#!/usr/bin/env python3
"""Compares two safetensors weight files as `--save-weights` writes them (float32 tensors),
with the standard library alone: the same tensor names and shapes, and per tensor the
largest difference over the tensor's largest value. Exits 1 when that exceeds --tol.

    python3 scripts/compare_weights.py A.safetensors B.safetensors --tol 1e-5

B may be several files, read as one: the weights of a model split into pipeline stages,
each stage's file holding its own layers' tensors (a tensor in two files is an error).
"""
import argparse
import json
import struct
import sys


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            sys.exit(f"{path}: {name} is {t['dtype']}, expected F32")
        a, b = t["data_offsets"]
        count = (b - a) // 4
        tensors[name] = (t["shape"], struct.unpack(f"<{count}f", body[a:b]))
    return tensors


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b", nargs="+")
    p.add_argument("--tol", type=float, default=1e-5)
    args = p.parse_args()
    a, b = read(args.a), {}
    for path in args.b:
        part = read(path)
        twice = sorted(set(part) & set(b))
        if twice:
            sys.exit(f"{path}: {twice} also in an earlier file")
        b.update(part)
    if sorted(a) != sorted(b):
        sys.exit(f"different tensors: {sorted(a)} vs {sorted(b)}")
    worst, worst_name = 0.0, ""
    for name, (shape, x) in sorted(a.items()):
        shape_b, y = b[name]
        if shape != shape_b:
            sys.exit(f"{name}: shape {shape} vs {shape_b}")
        scale = max((abs(v) for v in x), default=0.0) or 1e-30
        d = max((abs(u - v) for u, v in zip(x, y)), default=0.0) / scale
        if d > worst:
            worst, worst_name = d, name
    verdict = "PASS" if worst <= args.tol else "FAIL"
    print(
        f"{verdict}: {len(a)} tensors; largest difference {worst:.3e} of its tensor's "
        f"largest value ({worst_name or '-'}), tolerance {args.tol:.0e}"
    )
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
