//! [`CpuArgs`]: a dispatch's resolved arguments as a CPU kernel body sees them.

use std::cell::Cell;

use crate::record::{Access, ArgRec, RawMem};

/// The arguments of one CPU kernel invocation.
///
/// Buffers come out as plain slices. Each argument may be taken once as
/// mutable (and only if the dispatch declared it written) or any number of
/// times as shared; the encoder has already rejected dispatches whose written
/// argument overlaps another of their arguments, and the hazard tracker keeps
/// conflicting dispatches out of one concurrent group, so the slices never alias.
pub struct CpuArgs<'a> {
    args: &'a [ArgRec],
    bytes: &'a [u8],
    taken_mut: Cell<u64>,
    taken_shared: Cell<u64>,
}

impl<'a> CpuArgs<'a> {
    /// The number of arguments.
    pub fn len(&self) -> usize {
        self.args.len()
    }

    pub fn is_empty(&self) -> bool {
        self.args.is_empty()
    }

    /// The arguments of one dispatch: `args` index into `bytes`, the
    /// program's inline-byte arena.
    pub(crate) fn new(args: &'a [ArgRec], bytes: &'a [u8]) -> CpuArgs<'a> {
        CpuArgs {
            args,
            bytes,
            taken_mut: Cell::new(0),
            taken_shared: Cell::new(0),
        }
    }

    fn buffer(&self, i: usize) -> std::result::Result<(RawMem, usize, usize, Access), String> {
        match self.args.get(i) {
            Some(&ArgRec::Buffer {
                mem,
                offset,
                len,
                access,
                ..
            }) => Ok((mem, offset, len, access)),
            Some(ArgRec::Bytes { .. }) => {
                Err(format!("argument {i} is inline bytes, not a buffer"))
            }
            None => Err(format!("argument {i} missing ({} given)", self.args.len())),
        }
    }

    /// Argument `i` as a shared slice of `T`.
    pub fn read<T: bytemuck::Pod>(&self, i: usize) -> std::result::Result<&'a [T], String> {
        let (mem, offset, len, _) = self.buffer(i)?;
        let bit = 1u64.checked_shl(i as u32).unwrap_or(0);
        if self.taken_mut.get() & bit != 0 {
            return Err(format!("argument {i} is already borrowed mutably"));
        }
        self.taken_shared.set(self.taken_shared.get() | bit);
        // SAFETY: `mem + offset .. + len` lies inside a live allocation that
        // the submission retains for as long as the program runs; no dispatch
        // running concurrently writes these bytes (hazard tracking), and this
        // dispatch's mutable borrows never overlap it (checked above and at encode).
        let bytes =
            unsafe { std::slice::from_raw_parts((mem as usize + offset) as *const u8, len) };
        bytemuck::try_cast_slice(bytes).map_err(|e| format!("argument {i}: {e}"))
    }

    /// Argument `i` as a mutable slice of `T`; it must be declared written.
    #[allow(clippy::mut_from_ref)]
    pub fn write<T: bytemuck::Pod>(&self, i: usize) -> std::result::Result<&'a mut [T], String> {
        let (mem, offset, len, access) = self.buffer(i)?;
        if !access.writes() {
            return Err(format!("argument {i} is declared read-only"));
        }
        if i >= 64 {
            return Err(format!("argument {i}: at most 64 arguments can be written"));
        }
        let bit = 1u64 << i;
        if (self.taken_mut.get() | self.taken_shared.get()) & bit != 0 {
            return Err(format!("argument {i} is already borrowed"));
        }
        self.taken_mut.set(self.taken_mut.get() | bit);
        // SAFETY: as in `read`; additionally this is the only borrow of
        // argument `i` (tracked above) and no other argument of the dispatch
        // overlaps a written one (checked at encode).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut((mem as usize + offset) as *mut u8, len) };
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| format!("argument {i}: {e}"))
    }

    /// Argument `i` as inline bytes.
    pub fn bytes(&self, i: usize) -> std::result::Result<&'a [u8], String> {
        match self.args.get(i) {
            Some(&ArgRec::Bytes { start, len }) => self
                .bytes
                .get(start as usize..start as usize + len as usize)
                .ok_or_else(|| format!("argument {i}: inline bytes out of range")),
            Some(_) => Err(format!("argument {i} is a buffer, not inline bytes")),
            None => Err(format!("argument {i} missing ({} given)", self.args.len())),
        }
    }

    /// Argument `i` as an inline value of type `T`.
    pub fn scalar<T: bytemuck::Pod>(&self, i: usize) -> std::result::Result<T, String> {
        let b = self.bytes(i)?;
        if b.len() != std::mem::size_of::<T>() {
            return Err(format!(
                "argument {i}: {} inline bytes, expected {}",
                b.len(),
                std::mem::size_of::<T>()
            ));
        }
        Ok(bytemuck::pod_read_unaligned(b))
    }
}
