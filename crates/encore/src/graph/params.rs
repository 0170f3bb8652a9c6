//! Graph parameters: named 32-bit scalars in device memory.
//!
//! Kernels read a parameter through a buffer argument (a 4-byte view of the
//! block), never through an inline value, so a captured graph reads whatever
//! the block holds when it runs. Replaying with new values writes the block
//! before the graph starts; nothing in the graph is updated or re-recorded.

use crate::buffer::Buffer;
use crate::device::Device;
use crate::error::{Error, Result};

/// A block of named `u32` parameters (store `i32`/`f32` by their bits).
#[derive(Clone, Debug)]
pub struct Params {
    buffer: Buffer,
    names: Vec<String>,
}

impl Params {
    /// Allocates a block with one zeroed slot per name.
    pub fn new(device: &Device, names: &[&str]) -> Result<Params> {
        let buffer = device.alloc(names.len().max(1) * 4)?;
        buffer.upload(&vec![0u32; names.len().max(1)])?;
        Ok(Params {
            buffer,
            names: names.iter().map(|s| s.to_string()).collect(),
        })
    }

    /// The slot index of `name`.
    pub fn index(&self, name: &str) -> Result<usize> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| Error::Graph(format!("no parameter named `{name}`")))
    }

    /// The 4-byte view a kernel binds (read-only) to read `name`.
    pub fn slot(&self, name: &str) -> Result<Buffer> {
        self.buffer.view(self.index(name)? * 4, 4)
    }

    /// The whole block.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// Parameter names in slot order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Writes a value now, ordered after all submitted work (eager use).
    pub fn set(&self, name: &str, value: u32) -> Result<()> {
        self.buffer
            .upload_at(self.index(name)? * 4, &value.to_le_bytes())
    }
}
