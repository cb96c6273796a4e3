//! The `.cu` sources, embedded in the binary, and which module defines which kernel.
//!
//! A module is one `.cu` file compiled on its own (NVRTC on the device, on first use of one of
//! its kernels). [`module_source`] gives what NVRTC compiles: `common.cuh` followed by the file,
//! so no include path is needed; the sources include no CUDA header at all.

/// `kernels/cuda/common.cuh`.
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One `.cu` file: its module name (the file stem), its text, and the name prefixes of the
/// kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub module: &'static str,
    pub text: &'static str,
    pub prefixes: &'static [&'static str],
}

/// Every kernel source.
pub const SOURCES: &[Source] = &[
    Source {
        module: "elementwise",
        text: include_str!("../../cuda/elementwise.cu"),
        prefixes: &[
            "mw_cast_",
            "mw_add_n_",
            "mw_accumulate_",
            "mw_concat_",
            "mw_bias_add_",
            "mw_all_finite_",
            "mw_copy_",
        ],
    },
    Source {
        module: "activation",
        text: include_str!("../../cuda/activation.cu"),
        prefixes: &["mw_act_", "mw_softmax_", "mw_causal_mask_"],
    },
    Source {
        module: "loss",
        text: include_str!("../../cuda/loss.cu"),
        prefixes: &["mw_scce_", "mw_elem_loss_", "mw_kl_"],
    },
    Source {
        module: "norm",
        text: include_str!("../../cuda/norm.cu"),
        prefixes: &["mw_column_sums_", "mw_bn_", "mw_ln_"],
    },
    Source {
        module: "pool",
        text: include_str!("../../cuda/pool.cu"),
        prefixes: &["mw_maxpool_", "mw_avgpool_", "mw_gap_"],
    },
    Source {
        module: "conv",
        text: include_str!("../../cuda/conv.cu"),
        prefixes: &["mw_im2col_", "mw_col2im_", "mw_dw_"],
    },
    Source {
        module: "random",
        text: include_str!("../../cuda/random.cu"),
        prefixes: &["mw_philox_", "mw_dropout_", "mw_sample_normal_"],
    },
    Source {
        module: "optimizer",
        text: include_str!("../../cuda/optimizer.cu"),
        prefixes: &["mw_sgd", "mw_rmsprop", "mw_adam"],
    },
    Source {
        module: "embedding",
        text: include_str!("../../cuda/embedding.cu"),
        prefixes: &["mw_embedding_"],
    },
];

/// The source that defines kernel `name`, by its prefix.
pub fn source_of(kernel: &str) -> Option<&'static Source> {
    SOURCES
        .iter()
        .find(|s| s.prefixes.iter().any(|p| kernel.starts_with(p)))
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
