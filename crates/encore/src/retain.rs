//! What in-flight work keeps alive (invariant 1): each allocation and
//! kernel bound into a submission or graph, once, until its completion has
//! been observed.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::backend::BackendSubmission;
use crate::kernel::Kernel;
use crate::pool::Allocation;
use crate::program::Program;
use crate::record::Replay;

/// Keeps an executable's owned state alive for in-flight replays.
pub(crate) type Keep = Arc<dyn std::any::Any + Send + Sync>;

/// Hashes allocation ids (already unique integers) by identity.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Everything a submission or graph keeps alive: each allocation and kernel
/// bound into it, once.
#[derive(Default)]
pub(crate) struct Retained {
    pub(crate) allocations: IdMap<Arc<Allocation>>,
    pub(crate) kernels: Vec<Kernel>,
    /// Other owners of device state, such as a replayed graph executable;
    /// held only so they outlive the work.
    #[allow(dead_code)]
    pub(crate) keep: Vec<Keep>,
}

impl Retained {
    pub(crate) fn retain_allocation(&mut self, alloc: &Arc<Allocation>) {
        self.allocations
            .entry(alloc.id)
            .or_insert_with(|| alloc.clone());
    }

    pub(crate) fn retain_kernel(&mut self, kernel: &Kernel) {
        if !self.kernels.iter().any(|k| k.same(kernel)) {
            self.kernels.push(kernel.clone());
        }
    }
}

pub(crate) struct InFlight {
    pub(crate) backend: Box<dyn BackendSubmission>,
    pub(crate) retained: Retained,
    pub(crate) program: Arc<Program>,
    /// Set for graph replays.
    pub(crate) replay: Option<Replay>,
}
