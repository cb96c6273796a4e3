//! Compiles every `kernels/cuda/*.cu` as C++ with the emulation shim into one static library,
//! and generates the registry of its `extern "C" __global__` kernels (name → launcher and
//! parameter signature) by scanning the preprocessed sources.
//!
//! Two things make the emulation stricter than the sources alone would (docs/CUDA.md,
//! "Emulation"):
//! - every `__shared__` declaration is followed by a call that tells the emulator where the
//!   variable lives, so it fills it with NaN bytes the first time a block reaches it (a kernel
//!   that reads shared memory it did not write gets NaN). The sources are copied into
//!   `OUT_DIR` with that call appended on the declaration's own line, so line numbers stay;
//! - with GCC the library is compiled with `-fsanitize=thread` but without TSan's runtime:
//!   the compiler then calls `__tsan_read4(addr)`, `__tsan_write2(addr)` … around every
//!   memory access of the kernels, and runtime.h defines those hooks itself. They return at
//!   once unless a launch checks for races (`MW_EMU_RACES=1`), when they log global and
//!   shared memory accesses and flag unordered conflicting ones.

use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let cuda = manifest
        .join("../cuda")
        .canonicalize()
        .expect("kernels/cuda");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&cuda)
        .expect("read kernels/cuda")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    println!("cargo:rerun-if-changed={}", cuda.display());
    for p in sources.iter().chain(
        [
            cuda.join("common.cuh"),
            cuda.join("emu/shim.h"),
            cuda.join("emu/runtime.h"),
            cuda.join("emu/selftest.cu"),
        ]
        .iter(),
    ) {
        println!("cargo:rerun-if-changed={}", p.display());
    }

    // The sources with their `__shared__` declarations registered (see the top), laid out as
    // in kernels/cuda so that `#include "common.cuh"` and `"../common.cuh"` still resolve.
    let copy = out.join("cu");
    std::fs::create_dir_all(copy.join("emu")).unwrap();
    std::fs::copy(cuda.join("common.cuh"), copy.join("common.cuh")).unwrap();
    let mut copies = Vec::new();
    for (s, rel) in sources
        .iter()
        .map(|s| (s.clone(), PathBuf::from(s.file_name().unwrap())))
        // The emulator's own test kernels (misused barriers, races), not kernel sources.
        .chain([(
            cuda.join("emu/selftest.cu"),
            PathBuf::from("emu/selftest.cu"),
        )])
    {
        let text = std::fs::read_to_string(&s).unwrap();
        // `#line` keeps compiler messages pointing at the real file.
        let body = format!(
            "#line 1 \"{}\"\n{}",
            s.display(),
            register_shared(&s, &text)
        );
        std::fs::write(copy.join(&rel), body).unwrap();
        copies.push(copy.join(&rel));
    }

    // One translation unit: the shim, every kernel source, then the launcher and registry.
    let mut all = format!("#include \"{}\"\n", cuda.join("emu/shim.h").display());
    for s in &copies {
        all += &format!("#include \"{}\"\n", s.display());
    }
    all += &format!(
        "#ifndef MW_EMU_SCAN\n#include \"{}\"\n#endif\n",
        cuda.join("emu/runtime.h").display()
    );
    let all_path = out.join("mw_emu_all.cpp");
    std::fs::write(&all_path, all).unwrap();

    // Kernel names: `extern "C" __global__ void NAME(` with `__global__` expanded by the shim,
    // and `__launch_bounds__(N)` before the name as `mw_emu_bound(N)` (N as the preprocessor
    // leaves it: a product such as `32 * 8`).
    std::fs::write(out.join("registry.inc"), "").unwrap();
    let expanded = base(&out)
        .define("MW_EMU_SCAN", None)
        .file(&all_path)
        .expand();
    let text = String::from_utf8_lossy(&expanded);
    let marker = "__attribute__((used)) void ";
    let mut names: Vec<(String, u64)> = Vec::new();
    let mut rest = &text[..];
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let mut bound = 0;
        if let Some(after) = rest.strip_prefix("mw_emu_bound(") {
            let end = after.find(')').expect("mw_emu_bound( closes");
            bound = after[..end]
                .split('*')
                .map(|f| {
                    f.trim()
                        .parse::<u64>()
                        .expect("a launch bound is a product of numbers")
                })
                .product();
            rest = after[end + 1..].trim_start();
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && !names.iter().any(|(n, _)| *n == name) {
            names.push((name, bound));
        }
    }
    assert!(
        names.len() > 10,
        "found only {} kernels in the preprocessed sources",
        names.len()
    );
    let registry: String = names
        .iter()
        .map(|(n, b)| format!("MW_EMU_REG({n}, {b})\n"))
        .collect();
    std::fs::write(out.join("registry.inc"), registry).unwrap();

    let mut lib = base(&out);
    // The race log's hooks (runtime.h): GCC instruments every load and store with a call to
    // `__tsan_{read,write}N`, which runtime.h defines, and leaves atomics and functions marked
    // `no_sanitize("thread")` alone. Clang would also route atomics through `__tsan_atomic*`,
    // which the emulator does not define, so other compilers build without the hooks and a
    // launch that asks for the race check fails with a message saying so.
    if lib.get_compiler().is_like_gnu() {
        lib.flag("-fsanitize=thread")
            .flag("--param=tsan-instrument-func-entry-exit=0")
            .define("MW_EMU_RACE_HOOKS", None);
    }
    lib.file(&all_path).compile("mwemu");
}

/// `text` with `mw_emu::shared_decl(&NAME, sizeof NAME, "NAME");` after each `__shared__`
/// declaration, on the same line. Only the one form the kernels use is accepted — one
/// variable per declaration, on one line, inside a function — so that a new form fails the
/// build here instead of going unregistered (and unfilled).
fn register_shared(path: &Path, text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 1024);
    for (n, line) in text.lines().enumerate() {
        out += line;
        let decl = line.trim_start();
        if let Some(rest) = decl.strip_prefix("__shared__") {
            let fail = |why: &str| -> ! {
                panic!(
                    "{}:{}: {why} (the emulator registers one `__shared__ T name[..];` per line)",
                    path.display(),
                    n + 1
                )
            };
            let Some(end) = rest.find(';') else {
                fail("declaration does not end on its line")
            };
            let declarator = rest[..end].split('=').next().unwrap();
            let before_dims = declarator.split('[').next().unwrap();
            if before_dims.contains(',') || before_dims.contains('(') {
                fail("not a single variable");
            }
            let name = before_dims.split_whitespace().last().unwrap_or("");
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                fail("no variable name");
            }
            let at =
                out.len() - line.len() + (line.len() - decl.len()) + "__shared__".len() + end + 1;
            out.insert_str(
                at,
                &format!(" mw_emu::shared_decl(&{name}, sizeof {name}, \"{name}\");"),
            );
        }
        out.push('\n');
    }
    out
}

fn base(out: &Path) -> cc::Build {
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .opt_level(2)
        .include(out)
        .warnings(false)
        .flag_if_supported("-Wno-unknown-pragmas")
        // No fused multiply-adds: the CPU kernels round every operation.
        .flag_if_supported("-ffp-contract=off");
    b
}
