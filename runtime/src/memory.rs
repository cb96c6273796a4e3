//! `Region`: one zeroed, 256-byte-aligned host allocation (the arena, or the persistent
//! region), and typed views into it at planned offsets; and how the host allocator is asked
//! to hand large freed blocks back ([`return_large_frees`]).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::error::RuntimeError;

/// Alignment of every region (the planner's `ALIGNMENT`).
pub const REGION_ALIGN: usize = 256;

/// One host allocation made when a model is built and never resized.
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// The region is plain bytes; the executor hands out non-overlapping views (see `view`).
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Allocates `len` zeroed bytes, or says why it could not.
    pub fn new(len: usize, what: &str) -> Result<Region, RuntimeError> {
        if len == 0 {
            return Ok(Region {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(len, REGION_ALIGN)
            .map_err(|e| RuntimeError::Memory(format!("{what}: {len} bytes: {e}")))?;
        // SAFETY: layout has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            RuntimeError::Memory(format!("{what}: the allocator refused {len} bytes"))
        })?;
        Ok(Region { ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The whole region as bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (or dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A typed view of `elems` elements at byte `offset`.
    ///
    /// # Safety
    /// The caller guarantees no live `&mut` view overlaps this one. The bounds and the
    /// alignment are checked here (an `Err`, never out-of-bounds memory).
    pub unsafe fn view<T>(&self, offset: u64, elems: usize) -> Result<&[T], RuntimeError> {
        let p = self.checked::<T>(offset, elems)?;
        Ok(std::slice::from_raw_parts(p, elems))
    }

    /// A mutable typed view of `elems` elements at byte `offset`.
    ///
    /// # Safety
    /// The caller guarantees no other live view overlaps this one.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn view_mut<T>(&self, offset: u64, elems: usize) -> Result<&mut [T], RuntimeError> {
        let p = self.checked::<T>(offset, elems)?;
        Ok(std::slice::from_raw_parts_mut(p, elems))
    }

    /// The address of `elems` elements of `T` at byte `offset`, refused unless they lie inside
    /// the region at an offset aligned for `T`.
    fn checked<T>(&self, offset: u64, elems: usize) -> Result<*mut T, RuntimeError> {
        let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
        let end = (offset as usize).checked_add(elems.saturating_mul(size));
        match end {
            Some(end) if end <= self.len && (offset as usize).is_multiple_of(align) => {
                // SAFETY: offset < len (or elems == 0 and offset <= len).
                Ok(unsafe { self.ptr.as_ptr().add(offset as usize) }.cast::<T>())
            }
            _ => Err(RuntimeError::Memory(format!(
                "view of {elems}×{size} bytes at offset {offset} is outside the {}-byte region",
                self.len
            ))),
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `new` with this layout.
            unsafe {
                dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, REGION_ALIGN),
                )
            };
        }
    }
}

/// Blocks of at least this many bytes are mapped and unmapped by the allocator on their own.
pub const LARGE_BLOCK_BYTES: usize = 1 << 20;

/// Makes glibc's allocator return every block of [`LARGE_BLOCK_BYTES`] or more to the kernel
/// when it is freed (`mallopt(M_MMAP_THRESHOLD, 1 MiB)`); called once when a CPU executor is
/// built. Why: the CPU GEMM library allocates its packed operands on every call (3 MiB for
/// the MNIST MLP's first layer at batch 4096) and frees them before it returns. glibc's
/// default threshold adapts upwards after such a free, so later calls are served from the
/// calling thread's heap arena, which keeps the block when it is freed — one more block per
/// thread that calls a GEMM, resident for good: +9.5 MiB over 7 steps on that model, memory
/// no plan describes. With the threshold pinned, the block is unmapped at free and the
/// resident size follows what is live. Cost: a fresh mapping per large GEMM call (page
/// faults on 3 MiB, a few percent of a step that large); smaller GEMMs are not affected.
/// A threshold the user set (`MALLOC_MMAP_THRESHOLD_`) is left alone; a no-op off glibc.
pub fn return_large_frees() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
                return;
            }
            extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            const M_MMAP_THRESHOLD: i32 = -3;
            // SAFETY: mallopt only changes the allocator's tuning; glibc makes it thread-safe.
            unsafe {
                mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES as i32);
            }
        });
    }
}
