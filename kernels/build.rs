//! Records the optimisation level this crate is compiled at (cargo's `OPT_LEVEL` for the
//! package), so the runtime can warn when its kernels run unoptimised — about 100× slower.
fn main() {
    let level = std::env::var("OPT_LEVEL").unwrap_or_else(|_| "unknown".into());
    println!("cargo:rustc-env=MEMWISE_KERNELS_OPT_LEVEL={level}");
    println!("cargo:rerun-if-env-changed=OPT_LEVEL");
}
