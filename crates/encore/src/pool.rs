//! A memory pool that reuses freed allocations by size class.
//!
//! Memory reaches the pool only when the last [`crate::Buffer`] handle and the
//! last submission or graph retaining it have let go, so a block handed out
//! again is never still in use by the device (invariant 1).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::Result;
use crate::record::RawMem;

/// Statistics of a device's memory pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes in live allocations (size classes, not requested sizes).
    pub live_bytes: u64,
    /// Bytes held for reuse.
    pub pooled_bytes: u64,
    /// Allocations answered from the pool.
    pub reuses: u64,
    /// Allocations that went to the backend.
    pub fresh: u64,
}

/// Rounds a request up to its size class: multiples of 256 bytes up to 64 KiB,
/// then one eighth of the enclosing power of two, so at most 12.5% is wasted.
pub(crate) fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    if bytes <= 64 << 10 {
        return bytes.div_ceil(256) * 256;
    }
    let step = (bytes.next_power_of_two() / 16).max(256);
    bytes.div_ceil(step) * step
}

pub(crate) struct Pool {
    backend: Arc<dyn Backend>,
    free: Mutex<HashMap<usize, Vec<RawMem>>>,
    live: AtomicU64,
    pooled: AtomicU64,
    reuses: AtomicU64,
    fresh: AtomicU64,
}

impl Pool {
    pub(crate) fn new(backend: Arc<dyn Backend>) -> Pool {
        Pool {
            backend,
            free: Mutex::new(HashMap::new()),
            live: AtomicU64::new(0),
            pooled: AtomicU64::new(0),
            reuses: AtomicU64::new(0),
            fresh: AtomicU64::new(0),
        }
    }

    /// Takes a block of at least `bytes`; returns it with its class size.
    pub(crate) fn take(&self, bytes: usize) -> Result<(RawMem, usize)> {
        let class = size_class(bytes);
        let reused = self.free.lock().get_mut(&class).and_then(Vec::pop);
        let mem = match reused {
            Some(mem) => {
                self.pooled.fetch_sub(class as u64, Ordering::Relaxed);
                self.reuses.fetch_add(1, Ordering::Relaxed);
                mem
            }
            None => {
                self.fresh.fetch_add(1, Ordering::Relaxed);
                match self.backend.alloc(class) {
                    Ok(mem) => mem,
                    Err(_) => {
                        // Out of memory: give pooled blocks back and try once more.
                        self.trim();
                        self.backend.alloc(class)?
                    }
                }
            }
        };
        self.live.fetch_add(class as u64, Ordering::Relaxed);
        Ok((mem, class))
    }

    /// Returns a block no longer used by anything.
    pub(crate) fn give_back(&self, mem: RawMem, class: usize) {
        self.live.fetch_sub(class as u64, Ordering::Relaxed);
        self.pooled.fetch_add(class as u64, Ordering::Relaxed);
        self.free.lock().entry(class).or_default().push(mem);
    }

    /// Frees every pooled block.
    pub(crate) fn trim(&self) {
        let drained: Vec<(usize, Vec<RawMem>)> = self.free.lock().drain().collect();
        for (class, mems) in drained {
            for mem in mems {
                self.pooled.fetch_sub(class as u64, Ordering::Relaxed);
                self.backend.free(mem, class);
            }
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        PoolStats {
            live_bytes: self.live.load(Ordering::Relaxed),
            pooled_bytes: self.pooled.load(Ordering::Relaxed),
            reuses: self.reuses.load(Ordering::Relaxed),
            fresh: self.fresh.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.trim();
    }
}

static NEXT_ALLOCATION_ID: AtomicU64 = AtomicU64::new(1);

/// One block of device memory. It goes back to the pool when the last handle
/// (buffer, submission or graph) drops it.
pub(crate) struct Allocation {
    pub(crate) id: u64,
    pub(crate) mem: RawMem,
    pub(crate) class: usize,
    pub(crate) device_id: u64,
    pool: Arc<Pool>,
}

impl Allocation {
    /// Takes a block of at least `bytes` from `pool` for device `device_id`.
    pub(crate) fn take(pool: &Arc<Pool>, bytes: usize, device_id: u64) -> Result<Allocation> {
        let (mem, class) = pool.take(bytes)?;
        Ok(Allocation {
            id: NEXT_ALLOCATION_ID.fetch_add(1, Ordering::Relaxed),
            mem,
            class,
            device_id,
            pool: pool.clone(),
        })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.pool.give_back(self.mem, self.class);
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Allocation#{}({} bytes)", self.id, self.class)
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_cover_requests_with_little_waste() {
        for bytes in [
            1usize,
            255,
            256,
            257,
            65_536,
            65_537,
            1 << 20,
            (1 << 20) + 1,
            98_000_000,
        ] {
            let c = size_class(bytes);
            assert!(c >= bytes);
            assert!(c as f64 <= bytes as f64 * 1.125 + 256.0, "{bytes} -> {c}");
            assert_eq!(size_class(c), c, "classes are fixed points");
        }
    }
}
