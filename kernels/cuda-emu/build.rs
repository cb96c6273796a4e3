//! Compiles every `kernels/cuda/*.cu` as C++ with the emulation shim into one static library,
//! and generates the registry of its `extern "C" __global__` kernels (name → launcher and
//! parameter signature) by scanning the preprocessed sources.

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

    // One translation unit: the shim, every kernel source, then the launcher and registry.
    let mut all = format!("#include \"{}\"\n", cuda.join("emu/shim.h").display());
    for s in &sources {
        all += &format!("#include \"{}\"\n", s.display());
    }
    // The emulator's own test kernels (misused barriers), not part of the kernel sources.
    all += &format!("#include \"{}\"\n", cuda.join("emu/selftest.cu").display());
    all += &format!(
        "#ifndef MW_EMU_SCAN\n#include \"{}\"\n#endif\n",
        cuda.join("emu/runtime.h").display()
    );
    let all_path = out.join("mw_emu_all.cpp");
    std::fs::write(&all_path, all).unwrap();

    // Kernel names: `extern "C" __global__ void NAME(` with `__global__` expanded by the shim.
    std::fs::write(out.join("registry.inc"), "").unwrap();
    let expanded = base(&out)
        .define("MW_EMU_SCAN", None)
        .file(&all_path)
        .expand();
    let text = String::from_utf8_lossy(&expanded);
    let marker = "__attribute__((used)) void ";
    let mut names: Vec<String> = Vec::new();
    let mut rest = &text[..];
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && !names.contains(&name) {
            names.push(name);
        }
    }
    assert!(
        names.len() > 10,
        "found only {} kernels in the preprocessed sources",
        names.len()
    );
    let registry: String = names.iter().map(|n| format!("MW_EMU_REG({n})\n")).collect();
    std::fs::write(out.join("registry.inc"), registry).unwrap();

    base(&out).file(&all_path).compile("mwemu");
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
