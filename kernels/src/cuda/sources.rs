//! The `.cu` sources, embedded in the binary, and which module defines which kernel.
//!
//! A module is one `.cu` file compiled on its own (NVRTC on the device, on first use of one of
//! its kernels). [`module_source`] gives what NVRTC compiles: `common.cuh` followed by the file,
//! so no include path is needed; the sources include no CUDA header at all.

/// `kernels/cuda/common.cuh`.
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One `.cu` file: its module name (the file stem) and its text.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub module: &'static str,
    pub text: &'static str,
}

impl Source {
    /// The kernels this file defines, read from its `MW_KERNEL_1D NAME(` lines (every entry
    /// point is declared through one of common.cuh's `MW_KERNEL…` macros, which carry its
    /// launch bound; `MW_KERNEL(N) NAME(` too): a name, or for kernels stamped out per storage
    /// type by a macro the name's fixed part (`mw_act_fwd_` of `mw_act_fwd_##S`). Read from
    /// the text, so a new kernel needs no list here.
    pub fn kernel_prefixes(&self) -> impl Iterator<Item = &'static str> {
        let text = self.text;
        let marker = "MW_KERNEL";
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        text.match_indices(marker)
            .filter_map(move |(at, _)| {
                let mut rest = text[at + marker.len()..].trim_start_matches(ident);
                if let Some(bound) = rest.strip_prefix('(') {
                    rest = &bound[bound.find(')')? + 1..];
                }
                let rest = rest.trim_start();
                let end = rest.find(|c: char| !ident(c)).unwrap_or(rest.len());
                Some(&rest[..end])
            })
            .filter(|p| !p.is_empty())
    }
}

/// Every kernel source.
pub const SOURCES: &[Source] = &[
    Source {
        module: "elementwise",
        text: include_str!("../../cuda/elementwise.cu"),
    },
    Source {
        module: "activation",
        text: include_str!("../../cuda/activation.cu"),
    },
    Source {
        module: "loss",
        text: include_str!("../../cuda/loss.cu"),
    },
    Source {
        module: "norm",
        text: include_str!("../../cuda/norm.cu"),
    },
    Source {
        module: "pool",
        text: include_str!("../../cuda/pool.cu"),
    },
    Source {
        module: "conv",
        text: include_str!("../../cuda/conv.cu"),
    },
    Source {
        module: "random",
        text: include_str!("../../cuda/random.cu"),
    },
    Source {
        module: "optimizer",
        text: include_str!("../../cuda/optimizer.cu"),
    },
    Source {
        module: "embedding",
        text: include_str!("../../cuda/embedding.cu"),
    },
    Source {
        module: "attention",
        text: include_str!("../../cuda/attention.cu"),
    },
];

/// The source that defines kernel `name`: the one with the longest of
/// [`Source::kernel_prefixes`] that `name` starts with.
pub fn source_of(kernel: &str) -> Option<&'static Source> {
    SOURCES
        .iter()
        .flat_map(|s| s.kernel_prefixes().map(move |p| (p, s)))
        .filter(|(p, _)| kernel.starts_with(p))
        .max_by_key(|(p, _)| p.len())
        .map(|(_, s)| s)
}

/// What NVRTC compiles for module `module`: `common.cuh`, then the file without its
/// `#include "common.cuh"` line.
pub fn module_source(module: &str) -> Option<String> {
    let s = SOURCES.iter().find(|s| s.module == module)?;
    let body: String = s
        .text
        .lines()
        .filter(|l| l.trim() != "#include \"common.cuh\"")
        .map(|l| format!("{l}\n"))
        .collect();
    Some(format!("{COMMON}\n{body}"))
}
