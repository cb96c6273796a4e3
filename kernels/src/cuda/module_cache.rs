//! The on-disk cache of compiled kernel modules (CUBIN), and the rule for which driver can run
//! what NVRTC compiled.
//!
//! Why CUBIN and not PTX: PTX is compiled again by the driver when it loads, and PTX from a
//! newer NVRTC than the driver fails to load (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). A CUBIN
//! built for the device's own architecture loads on any driver of the same CUDA major version
//! (CUDA's minor-version compatibility), and loads without a JIT step.
//!
//! A cached file is only ever read back for exactly what produced it: its name holds the
//! module, the architecture, the NVRTC and driver versions and a fingerprint of the sources
//! and compile options. It is written to a temporary file and renamed, so a process killed
//! mid-write leaves either no file or a whole one; a file that still fails to load is removed
//! and compiled again by the caller ([`ModuleCache::discard`]).
//!
//! Plain Rust, built and tested without the `cuda` feature; the device (`device.rs`) uses it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The oldest CUDA driver API memwise runs on (its cudarc bindings are generated for CUDA
/// 13.0), as `cuDriverGetVersion` encodes it: 1000 × major + 10 × minor.
pub const MIN_DRIVER_VERSION: i32 = 13_000;

/// `(major, minor)` of a `cuDriverGetVersion` value (`13020` → `(13, 2)`).
pub fn driver_version_parts(v: i32) -> (i32, i32) {
    (v / 1000, (v % 1000) / 10)
}

/// Whether a driver reporting `driver` (as `cuDriverGetVersion`) can load CUBINs from an
/// NVRTC of version `nvrtc`: at least [`MIN_DRIVER_VERSION`], and of at least NVRTC's major
/// version. A message saying what to install otherwise.
pub fn check_versions(driver: i32, nvrtc: (i32, i32)) -> Result<(), String> {
    let (dmaj, dmin) = driver_version_parts(driver);
    let (min_maj, min_min) = driver_version_parts(MIN_DRIVER_VERSION);
    if driver < MIN_DRIVER_VERSION {
        return Err(format!(
            "the NVIDIA driver supports CUDA {dmaj}.{dmin}, and memwise needs CUDA \
             {min_maj}.{min_min} or newer: update the driver (CUDA {min_maj}.{min_min} needs an \
             R580 driver or newer)"
        ));
    }
    if nvrtc.0 > dmaj {
        return Err(format!(
            "NVRTC {}.{} compiles for a newer CUDA than the driver's {dmaj}.{dmin}: install an \
             NVRTC of CUDA {dmaj}.x (the nvidia-cuda-nvrtc wheel of that version) or update the \
             driver",
            nvrtc.0, nvrtc.1
        ));
    }
    Ok(())
}

/// What a compiled module was made from; two equal keys make the same CUBIN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleKey {
    pub module: String,
    /// `sm_90` …
    pub arch: String,
    pub nvrtc: (i32, i32),
    /// As `cuDriverGetVersion` reports it.
    pub driver: i32,
    /// Of the module sources and the compile options together.
    pub fingerprint: u64,
}

impl ModuleKey {
    /// The cache file's name: every field, so a changed toolchain never reads an old file.
    pub fn file_name(&self) -> String {
        format!(
            "{}-{}-nvrtc{}.{}-driver{}-{:016x}.cubin",
            self.module, self.arch, self.nvrtc.0, self.nvrtc.1, self.driver, self.fingerprint
        )
    }
}

/// FNV-1a over `parts`, each followed by a separator so that `["ab", "c"]` and `["a", "bc"]`
/// differ.
pub fn fingerprint<'a>(parts: impl IntoIterator<Item = &'a str>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain(std::iter::once(0)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// A folder of compiled modules.
#[derive(Clone, Debug)]
pub struct ModuleCache {
    dir: PathBuf,
}

/// Makes each temporary name of this process unique.
static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl ModuleCache {
    pub fn new(dir: impl Into<PathBuf>) -> ModuleCache {
        ModuleCache { dir: dir.into() }
    }

    /// `MEMWISE_KERNEL_CACHE`, else `~/.cache/memwise/kernels`; `None` without either (no
    /// cache: every process compiles).
    pub fn from_env() -> Option<ModuleCache> {
        std::env::var_os("MEMWISE_KERNEL_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memwise/kernels"))
            })
            .map(ModuleCache::new)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, key: &ModuleKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The cached CUBIN for `key`, if there is a non-empty one.
    pub fn load(&self, key: &ModuleKey) -> Option<Vec<u8>> {
        std::fs::read(self.path(key)).ok().filter(|b| !b.is_empty())
    }

    /// Writes `cubin` for `key`: into a temporary file in the same folder, synced, then renamed
    /// over the final name (atomic on POSIX), so readers see the old file, none, or the whole
    /// new one.
    pub fn store(&self, key: &ModuleKey, cubin: &[u8]) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let seq = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(
            ".{}.tmp-{}-{seq}",
            key.file_name(),
            std::process::id()
        ));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(cubin)?;
            f.sync_all()?;
            std::fs::rename(&tmp, self.path(key))
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Removes the file for `key` (one the driver refused to load), so it is compiled again.
    pub fn discard(&self, key: &ModuleKey) {
        let _ = std::fs::remove_file(self.path(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(driver: i32) -> ModuleKey {
        ModuleKey {
            module: "pool".into(),
            arch: "sm_90".into(),
            nvrtc: (13, 2),
            driver,
            fingerprint: fingerprint(["src", "--std=c++17"]),
        }
    }

    fn tmp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("memwise-cache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn the_file_name_changes_with_every_part_of_the_key() {
        let base = key(13_000);
        let mut names = vec![base.file_name()];
        let mut k = base.clone();
        k.driver = 13_020;
        names.push(k.file_name());
        let mut k = base.clone();
        k.nvrtc = (13, 0);
        names.push(k.file_name());
        let mut k = base.clone();
        k.arch = "sm_100".into();
        names.push(k.file_name());
        let mut k = base.clone();
        k.fingerprint = fingerprint(["src", "--std=c++20"]);
        names.push(k.file_name());
        let mut k = base.clone();
        k.module = "loss".into();
        names.push(k.file_name());
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert_ne!(fingerprint(["ab", "c"]), fingerprint(["a", "bc"]));
    }

    #[test]
    fn store_then_load_round_trips_and_leaves_no_temporary() {
        let dir = tmp_dir("roundtrip");
        let cache = ModuleCache::new(&dir);
        let k = key(13_000);
        assert_eq!(cache.load(&k), None);
        cache.store(&k, b"\x7fELF first").unwrap();
        cache.store(&k, b"\x7fELF second").unwrap();
        assert_eq!(cache.load(&k).as_deref(), Some(&b"\x7fELF second"[..]));
        assert_eq!(
            cache.load(&key(13_020)),
            None,
            "another driver reads its own file"
        );
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec![k.file_name()]);
        cache.discard(&k);
        assert_eq!(cache.load(&k), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_empty_file_is_not_a_module() {
        // What a write interrupted before its first byte would leave without the rename.
        let dir = tmp_dir("empty");
        let cache = ModuleCache::new(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(cache.path(&key(13_000)), b"").unwrap();
        assert_eq!(cache.load(&key(13_000)), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn old_drivers_and_newer_nvrtc_majors_are_refused_with_what_to_install() {
        assert!(
            check_versions(13_000, (13, 2)).is_ok(),
            "minor versions are compatible"
        );
        assert!(check_versions(13_020, (13, 0)).is_ok());
        let e = check_versions(12_080, (12, 8)).unwrap_err();
        assert!(
            e.contains("CUDA 12.8") && e.contains("13.0") && e.contains("R580"),
            "{e}"
        );
        let e = check_versions(13_000, (14, 0)).unwrap_err();
        assert!(e.contains("NVRTC 14.0") && e.contains("CUDA 13.x"), "{e}");
        assert_eq!(driver_version_parts(13_020), (13, 2));
    }
}
