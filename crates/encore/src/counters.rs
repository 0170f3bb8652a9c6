//! Counters of what the runtime did, cheap enough to be always on.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// A snapshot of a device's counters.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Counters {
            $($(#[$doc])* pub $name: u64,)*
        }

        /// The live, atomic counters of a device.
        #[derive(Debug, Default)]
        pub(crate) struct AtomicCounters {
            $($name: AtomicU64,)*
        }

        impl AtomicCounters {
            pub(crate) fn snapshot(&self) -> Counters {
                Counters { $($name: self.$name.load(Ordering::Relaxed),)* }
            }

            pub(crate) fn reset(&self) {
                $(self.$name.store(0, Ordering::Relaxed);)*
            }

            /// Adds a batch of locally accumulated counts.
            pub(crate) fn add(&self, c: &Counters) {
                $(if c.$name != 0 { self.$name.fetch_add(c.$name, Ordering::Relaxed); })*
            }
        }

        impl Counters {
            /// Field names and values, in declaration order, for tables and JSON.
            pub fn entries(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }

            /// The difference `self - earlier`, field by field.
            pub fn since(&self, earlier: &Counters) -> Counters {
                Counters { $($name: self.$name.wrapping_sub(earlier.$name),)* }
            }
        }
    };
}

counters! {
    /// Kernel dispatches encoded (eager) or replayed (graph nodes).
    dispatches,
    /// Command batches submitted to the device.
    submissions,
    /// Host waits on a submission or on the whole device.
    waits,
    /// Barriers executed (explicit and automatic).
    barriers,
    /// Barriers the hazard tracker inserted.
    auto_barriers,
    /// Dispatches that joined an existing concurrent group.
    concurrent_dispatches,
    /// Kernels compiled (cache misses).
    kernel_compiles,
    /// Kernel loads answered from the cache.
    kernel_cache_hits,
    /// Kernels loaded from the on-disk cache instead of being compiled.
    kernel_disk_hits,
    /// Graph replays.
    graph_replays,
    /// Graph executables built (executable-cache misses).
    graph_instantiations,
    /// Graph executables reused from the executable cache.
    graph_cache_hits,
}
