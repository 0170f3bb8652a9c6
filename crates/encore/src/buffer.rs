//! Buffers: cheap-to-clone handles to device memory, and views into them.

use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::pool::{Allocation, Pool};

impl Device {
    /// Allocates `bytes` of device memory (contents unspecified), reusing
    /// pooled memory when possible.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer> {
        self.check_failed()?;
        Buffer::new(self, self.pool(), bytes)
    }

    /// Allocates a buffer holding `data`.
    pub fn buffer_from<T: bytemuck::Pod>(&self, data: &[T]) -> Result<Buffer> {
        let buf = self.alloc(std::mem::size_of_val(data))?;
        buf.upload(data)?;
        Ok(buf)
    }
}

/// A handle to a byte range of device memory.
///
/// Cloning is cheap (a reference count). A buffer made by [`Device::alloc`]
/// spans its allocation; [`Buffer::view`] narrows it. Views of one allocation
/// are tracked for hazards by their byte ranges.
#[derive(Clone, Debug)]
pub struct Buffer {
    pub(crate) alloc: Arc<Allocation>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) device: Device,
}

impl Buffer {
    pub(crate) fn new(device: &Device, pool: &Arc<Pool>, bytes: usize) -> Result<Buffer> {
        let alloc = Allocation::take(pool, bytes, device.id())?;
        Ok(Buffer {
            alloc: Arc::new(alloc),
            offset: 0,
            len: bytes,
            device: device.clone(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer spans zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Byte offset of this view inside its allocation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The device the memory lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An identifier of the underlying allocation, shared by all its views.
    pub fn allocation_id(&self) -> u64 {
        self.alloc.id
    }

    /// A view of `len` bytes starting `offset` bytes into this buffer.
    pub fn view(&self, offset: usize, len: usize) -> Result<Buffer> {
        let end = offset.checked_add(len).ok_or(Error::OutOfRange {
            what: "view",
            offset,
            end: usize::MAX,
            len: self.len,
        })?;
        if end > self.len {
            return Err(Error::OutOfRange {
                what: "view",
                offset,
                end,
                len: self.len,
            });
        }
        Ok(Buffer {
            alloc: self.alloc.clone(),
            offset: self.offset + offset,
            len,
            device: self.device.clone(),
        })
    }

    /// A view of `count` elements of `T` starting at element `start`.
    pub fn view_elems<T>(&self, start: usize, count: usize) -> Result<Buffer> {
        let size = std::mem::size_of::<T>();
        let bad = || Error::OutOfRange {
            what: "view_elems",
            offset: start.saturating_mul(size),
            end: usize::MAX,
            len: self.len,
        };
        self.view(
            start.checked_mul(size).ok_or_else(bad)?,
            count.checked_mul(size).ok_or_else(bad)?,
        )
    }

    /// Copies `data` into the start of this buffer, after all submitted work.
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<()> {
        self.upload_at(0, bytemuck::cast_slice(data))
    }

    /// Copies `bytes` into this buffer at byte `offset`, after all submitted work.
    pub fn upload_at(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        let end = self.check_range("upload", offset, bytes.len())?;
        let _ = end;
        self.device
            .backend()
            .write(self.alloc.mem, self.offset + offset, bytes)
    }

    /// Copies the whole buffer out as elements of `T`, after all submitted work.
    pub fn download<T: bytemuck::Pod>(&self) -> Result<Vec<T>> {
        let n = self.len / std::mem::size_of::<T>().max(1);
        let mut out = vec![T::zeroed(); n];
        self.download_into(&mut out)?;
        Ok(out)
    }

    /// Fills `out` from the start of this buffer, after all submitted work.
    pub fn download_into<T: bytemuck::Pod>(&self, out: &mut [T]) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        self.check_range("download", 0, bytes.len())?;
        self.device
            .backend()
            .read(self.alloc.mem, self.offset, bytes)
    }

    /// Fills `out` from the start of this buffer as `after` left it: waits
    /// for `after` to complete, but not for work submitted later, which
    /// keeps the device busy meanwhile. Later work must not write the bytes
    /// read (they would come back in an unspecified state); this is for
    /// reading results while the next work runs, such as the tokens of one
    /// batch of decode steps while the next batch decodes.
    pub fn download_after<T: bytemuck::Pod>(
        &self,
        after: &crate::Submission,
        out: &mut [T],
    ) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        Self::read_all_after("download_after", after, &mut [(self, bytes)])
    }

    /// [`Buffer::download_after`] of several buffers at once (`reads` pairs
    /// each with the bytes it fills from its start), which the device
    /// may make one copy: all of them on the device of `after`.
    pub fn download_all_after(
        after: &crate::Submission,
        reads: &mut [(&Buffer, &mut [u8])],
    ) -> Result<()> {
        Self::read_all_after("download_all_after", after, reads)
    }

    /// The reads of [`Buffer::download_all_after`], for the operation `what`.
    fn read_all_after(
        what: &'static str,
        after: &crate::Submission,
        reads: &mut [(&Buffer, &mut [u8])],
    ) -> Result<()> {
        let mut ranges = Vec::with_capacity(reads.len());
        for (buffer, out) in reads.iter_mut() {
            buffer.check_range("download", 0, out.len())?;
            if !after.device().same(&buffer.device) {
                return Err(Error::WrongDevice(what));
            }
            ranges.push((buffer.alloc.mem, buffer.offset, &mut **out));
        }
        after.wait()?;
        after.device().backend().read_settled_many(&mut ranges)
    }

    fn check_range(&self, what: &'static str, offset: usize, len: usize) -> Result<usize> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(end),
            end => Err(Error::OutOfRange {
                what,
                offset,
                end: end.unwrap_or(usize::MAX),
                len: self.len,
            }),
        }
    }
}
