#!/usr/bin/env python3
"""Compiles every kernel module with NVRTC exactly as the runtime does (kernels/src/cuda/
sources.rs: common.cuh, then the .cu file without its `#include "common.cuh"` line; no include
path; the options of kernels/src/cuda/device.rs), then assembles the PTX with ptxas, and checks
that every kernel declares its launch bound and that a block of that many threads fits an SM's
register file with the registers ptxas gave it.

usage: nvrtc_check.py LIBNVRTC ARCH OUTDIR KERNELS_CUDA_DIR
"""
import ctypes
import os
import re
import subprocess
import sys

# An SM's register file (sm_90, as every architecture since sm_50): a block of the kernel's
# launch bound must fit in it, or the launch fails (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
SM_REGISTERS = 65536


def register_file_check(ptx, ptxas_log):
    """Every entry of `ptx` declares its block bound (`.maxntid`, from `__launch_bounds__`),
    and its registers (from `ptxas -v`) times that many threads fit an SM's register file."""
    bounds = {}
    for chunk in ptx.split(".entry ")[1:]:
        name = re.match(r"\w+", chunk).group(0)
        head = chunk[: chunk.find("{")]
        m = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", head)
        bounds[name] = int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else None
    regs, fn = {}, None
    for line in ptxas_log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            regs[fn] = int(m.group(1))
    bad = []
    for fn, threads in sorted(bounds.items()):
        if threads is None:
            bad.append(f"{fn} declares no __launch_bounds__ (use a MW_KERNEL_* macro)")
        elif fn not in regs:
            bad.append(f"ptxas -v reported no registers for {fn}")
        elif regs[fn] * threads > SM_REGISTERS:
            bad.append(f"{fn}: {regs[fn]} registers x {threads} threads > {SM_REGISTERS}")
    return bad


lib_path, arch, out, src_dir = sys.argv[1:5]
nvrtc = ctypes.CDLL(lib_path)
# Keep in sync with NVRTC_OPTIONS in kernels/src/cuda/compile.rs.
options = [f"--gpu-architecture={arch}", "--std=c++17"]

common = open(os.path.join(src_dir, "common.cuh")).read()
failed = 0
major, minor = ctypes.c_int(), ctypes.c_int()
nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
print(f"  NVRTC {major.value}.{minor.value} ({lib_path})")
for name in sorted(f for f in os.listdir(src_dir) if f.endswith(".cu")):
    body = "".join(
        line for line in open(os.path.join(src_dir, name)).read().splitlines(keepends=True)
        if line.strip() != '#include "common.cuh"'
    )
    src = f"{common}\n{body}".encode()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None)
    if rc != 0:
        print(f"FAILED: nvrtcCreateProgram({name}) = {rc}")
        failed = 1
        continue
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if rc != 0:
        print(f"FAILED: NVRTC {name}:\n{text}")
        failed = 1
        continue
    if text:
        print(f"  {name}: NVRTC says:\n{text}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    ptx_path = os.path.join(out, name.replace(".cu", ".nvrtc.ptx"))
    with open(ptx_path, "wb") as f:
        f.write(ptx.value)
    entries = ptx.value.count(b".entry ")
    asm = subprocess.run(["ptxas", "-v", f"-arch={arch}", ptx_path, "-o", ptx_path + ".cubin"],
                         capture_output=True, text=True)
    if asm.returncode != 0:
        print(f"FAILED: ptxas on the NVRTC PTX of {name}:\n{asm.stderr}")
        failed = 1
        continue
    bad = register_file_check(ptx.value.decode(), asm.stdout + asm.stderr)
    for b in bad:
        print(f"FAILED: {name}: {b}")
    failed |= bool(bad)
    print(f"  {name}: {entries} kernels, PTX assembles for {arch}, each block's registers fit an SM")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
sys.exit(failed)
