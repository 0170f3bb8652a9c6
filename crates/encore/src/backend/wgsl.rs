//! The argument block of a WGSL kernel, shared by the wgpu and Metal
//! backends, which run the same kernels.
//!
//! A dispatch's block is what the kernel reads as
//! `@group(1) @binding(0) var<storage, read> args: Args` (the convention is
//! on [`crate::WgpuKernel`]): `off: array<u32, 16>`, the word offset of each
//! buffer argument's first byte within its binding (0 for an empty
//! argument), then the dispatch's value arguments, concatenated in order,
//! from byte [`OFFSETS_BYTES`]. A program's blocks live in one buffer, a
//! stride apart, which is a multiple of the alignment the device requires
//! of a binding's offset. Buffer arguments are bound from the multiple of
//! that alignment at or before their first byte ([`bind_range`]).

use crate::error::{Error, Result};
use crate::program::{DispatchRec, Program};
use crate::record::{ArgRec, RawMem};

/// The size of the word-offset table at the head of a WGSL kernel's
/// argument block: at most this many buffer arguments per dispatch.
pub const WGSL_MAX_BUFFERS: usize = 16;

/// Bytes of the offset table at the head of each argument block; the
/// value starts here.
pub(crate) const OFFSETS_BYTES: usize = WGSL_MAX_BUFFERS * 4;

/// Where a buffer argument over `offset..offset + len` of an allocation of
/// `size` bytes is bound: the binding's start (the multiple of `align` at
/// or before `offset`), the argument's first word within the binding (what
/// the kernel finds in `args.off`), and the bytes bound from the start
/// (through the argument's last word, within the allocation). `offset` is
/// a multiple of 4.
pub(crate) fn bind_range(
    offset: usize,
    len: usize,
    size: usize,
    align: usize,
) -> (usize, u32, usize) {
    let start = offset - offset % align;
    let words = ((offset - start) / 4) as u32;
    let bound = ((offset + len).next_multiple_of(4) - start).min(size.saturating_sub(start));
    (start, words, bound)
}

/// A buffer argument as bound for a dispatch: `bytes` of `buffer` (what
/// the backend's lookup gave for the allocation) from byte `start`.
pub(crate) struct Bound<B> {
    pub buffer: B,
    pub start: usize,
    pub bytes: usize,
}

/// The argument blocks of a program's dispatches, `stride` bytes apart.
pub(crate) struct ArgBlocks {
    bytes: Vec<u8>,
    stride: usize,
    align: usize,
}

impl ArgBlocks {
    /// Zeroed blocks for every dispatch of `program`, each long enough for
    /// the offset table and the widest value, on a device that binds
    /// buffers at multiples of `align` bytes.
    pub(crate) fn new(program: &Program, align: usize) -> ArgBlocks {
        let value_len = |d: &DispatchRec| -> usize {
            program
                .args_of(d)
                .iter()
                .map(|a| match a {
                    ArgRec::Bytes { len, .. } => *len as usize,
                    ArgRec::Buffer { .. } => 0,
                })
                .sum()
        };
        let widest = program.dispatches.iter().map(value_len).max().unwrap_or(0);
        let stride = (OFFSETS_BYTES + widest).next_multiple_of(align);
        ArgBlocks {
            bytes: vec![0u8; stride * program.dispatches.len().max(1)],
            stride,
            align,
        }
    }

    /// The distance between two dispatches' blocks, and each block's size.
    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    /// Every block, dispatch `i`'s at `i * stride`.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Writes the block of dispatch `d`, the `i`th of `program`, and
    /// returns how each of its buffer arguments is bound, in order (`None`
    /// for an empty one). `lookup` gives an allocation's buffer and size.
    /// A dispatch with more than [`WGSL_MAX_BUFFERS`] buffer arguments, or
    /// one that starts off a 4-byte boundary, is
    /// [`Error::InvalidDispatch`].
    pub(crate) fn fill<B>(
        &mut self,
        i: usize,
        program: &Program,
        d: &DispatchRec,
        mut lookup: impl FnMut(RawMem) -> Result<(B, usize)>,
    ) -> Result<Vec<Option<Bound<B>>>> {
        let block = &mut self.bytes[i * self.stride..(i + 1) * self.stride];
        let mut bound: Vec<Option<Bound<B>>> = Vec::new();
        let mut value_at = OFFSETS_BYTES;
        for arg in program.args_of(d) {
            match *arg {
                ArgRec::Buffer {
                    mem, offset, len, ..
                } => {
                    let index = bound.len();
                    if index == WGSL_MAX_BUFFERS {
                        return Err(invalid(
                            d,
                            format!("more than {WGSL_MAX_BUFFERS} buffer arguments"),
                        ));
                    }
                    if len == 0 {
                        bound.push(None);
                        continue;
                    }
                    if !offset.is_multiple_of(4) {
                        return Err(invalid(
                            d,
                            format!(
                                "buffer argument {index} starts at byte {offset}, \
                                 not a multiple of 4"
                            ),
                        ));
                    }
                    let (buffer, size) = lookup(mem)?;
                    let (start, words, bytes) = bind_range(offset, len, size, self.align);
                    block[index * 4..index * 4 + 4].copy_from_slice(&words.to_le_bytes());
                    bound.push(Some(Bound {
                        buffer,
                        start,
                        bytes,
                    }));
                }
                ArgRec::Bytes { start, len } => {
                    let (start, len) = (start as usize, len as usize);
                    let bytes = program
                        .bytes
                        .get(start..start + len)
                        .ok_or_else(|| invalid(d, "value outside the program's bytes".into()))?;
                    block[value_at..value_at + len].copy_from_slice(bytes);
                    value_at += len;
                }
            }
        }
        Ok(bound)
    }
}

/// Says why dispatch `d` cannot be bound.
fn invalid(d: &DispatchRec, reason: String) -> Error {
    Error::InvalidDispatch {
        kernel: d.kernel.name().to_string(),
        label: d.label.to_string(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::kernel::{KernelCache, KernelDef, Loaded};
    use crate::record::{Access, BackendKind, Launch};

    /// A program of one dispatch per list of arguments.
    fn program(dispatches: &[&[ArgRec]], bytes: Vec<u8>) -> Program {
        let def = KernelDef::new("k").cpu("k v1", |_| Ok(()));
        let key = KernelCache::key_for(BackendKind::Cpu, "x".into(), "t".into(), &def).unwrap();
        let kernel = match KernelCache::default().load(key, &def, |_| Ok(Arc::new(()))) {
            Ok(Loaded::Hit(k) | Loaded::Compiled(k)) => k,
            Err(e) => panic!("{e}"),
        };
        let mut p = Program {
            bytes,
            ..Program::default()
        };
        for args in dispatches {
            let at = p.args.len() as u32;
            p.args.extend_from_slice(args);
            p.dispatches.push(DispatchRec {
                kernel: kernel.clone(),
                args: at..p.args.len() as u32,
                launch: Launch::NONE,
                label: "d".into(),
            });
        }
        p.group_ends.push(p.dispatches.len() as u32);
        p
    }

    fn buffer(mem: RawMem, offset: usize, len: usize) -> ArgRec {
        ArgRec::Buffer {
            mem,
            offset,
            len,
            access: Access::Read,
        }
    }

    fn word(block: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
    }

    /// Every allocation is 4096 bytes; its buffer is its handle.
    fn lookup(mem: RawMem) -> Result<(RawMem, usize)> {
        Ok((mem, 4096))
    }

    #[test]
    fn arguments_bind_at_an_aligned_start_with_their_word_offset() {
        // Inside an allocation: from the 256-byte boundary below, through
        // the argument's last word.
        assert_eq!(bind_range(1000, 10, 4096, 256), (768, 58, 244));
        assert_eq!(bind_range(512, 64, 4096, 256), (512, 0, 64));
        // Never past the allocation's end.
        assert_eq!(bind_range(4088, 6, 4094, 256), (3840, 62, 254));
        // A device with a finer alignment binds closer to the argument.
        assert_eq!(bind_range(1000, 10, 4096, 32), (992, 2, 20));
    }

    /// The block a WGSL kernel reads: `off[i]` the word offset of buffer
    /// argument `i` (counting empty ones), then the values packed from
    /// byte 64, whatever the buffers between them.
    #[test]
    fn a_block_holds_the_offsets_then_the_values_in_order() {
        let values: Vec<u8> = [7u32, 3, 0x3f80_0000, 9]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let args = [
            buffer(1, 1000, 10),
            ArgRec::Bytes { start: 0, len: 8 },
            buffer(2, 0, 0),
            buffer(3, 516, 64),
            ArgRec::Bytes { start: 8, len: 8 },
        ];
        let p = program(&[&[buffer(4, 4, 4)], &args], values);
        let mut blocks = ArgBlocks::new(&p, 256);
        assert_eq!(blocks.stride(), 256, "64 bytes of offsets and 16 of value");
        assert_eq!(blocks.bytes().len(), 512);
        blocks.fill(0, &p, &p.dispatches[0], lookup).unwrap();
        let bound = blocks.fill(1, &p, &p.dispatches[1], lookup).unwrap();
        let block = &blocks.bytes()[256..];
        assert_eq!(word(block, 0), 58);
        assert_eq!(word(block, 4), 0, "an empty argument has no offset");
        assert_eq!(word(block, 8), 1);
        assert!((12..64).step_by(4).all(|at| word(block, at) == 0));
        assert_eq!(&block[64..80], &p.bytes[..]);
        assert!(block[80..].iter().all(|&b| b == 0));
        assert_eq!(word(blocks.bytes(), 0), 1, "the first dispatch's block");
        let bound: Vec<_> = bound
            .iter()
            .map(|b| b.as_ref().map(|b| (b.buffer, b.start, b.bytes)))
            .collect();
        assert_eq!(bound, [Some((1, 768, 244)), None, Some((3, 512, 68))]);
    }

    /// The value's place in the block is where naga, which compiles the
    /// kernels on both backends, lays out the fields after `off`.
    #[test]
    fn values_sit_where_a_wgsl_kernel_reads_its_fields() {
        let module = naga::front::wgsl::parse_str(
            "struct Shape { rows: u32, scale: f32, dims: array<u32, 3> }
             struct Args { off: array<u32, 16>, n: u32, s: Shape, eps: f32 }
             @group(1) @binding(0) var<storage, read> args: Args;
             @compute @workgroup_size(1) fn main() { _ = args.n; }",
        )
        .unwrap();
        let fields: Vec<(String, u32)> = module
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some("Args"))
            .map(|(_, t)| match &t.inner {
                naga::TypeInner::Struct { members, .. } => members
                    .iter()
                    .map(|m| (m.name.clone().unwrap_or_default(), m.offset))
                    .collect(),
                _ => Vec::new(),
            })
            .unwrap();
        // Three value arguments, as an op passes `n`, its shape and `eps`.
        let values: Vec<u8> = (1u32..=7).flat_map(|w| w.to_le_bytes()).collect();
        let args = [
            ArgRec::Bytes { start: 0, len: 4 },
            buffer(1, 0, 16),
            ArgRec::Bytes { start: 4, len: 20 },
            ArgRec::Bytes { start: 24, len: 4 },
        ];
        let p = program(&[&args], values);
        let mut blocks = ArgBlocks::new(&p, 64);
        blocks.fill(0, &p, &p.dispatches[0], lookup).unwrap();
        let block = blocks.bytes();
        assert_eq!(fields[0], ("off".to_string(), 0));
        for (name, first) in [("n", 1), ("s", 2), ("eps", 7)] {
            let at = fields.iter().find(|f| f.0 == name).unwrap().1 as usize;
            assert_eq!(word(block, at), first, "field {name} at byte {at}");
        }
        assert_eq!(blocks.stride() % 64, 0);
    }

    #[test]
    fn dispatches_the_block_cannot_describe_are_refused() {
        let many: Vec<ArgRec> = (0..17).map(|i| buffer(i, 0, 4)).collect();
        let odd = [buffer(1, 6, 4)];
        let outside = [ArgRec::Bytes { start: 4, len: 8 }];
        let p = program(&[&many, &odd, &outside], vec![0; 8]);
        let mut blocks = ArgBlocks::new(&p, 256);
        for (i, says) in [(0, "more than 16"), (1, "byte 6"), (2, "outside")] {
            match blocks.fill(i, &p, &p.dispatches[i], lookup) {
                Err(Error::InvalidDispatch { reason, .. }) => {
                    assert!(reason.contains(says), "{reason}")
                }
                other => panic!("dispatch {i}: {:?}", other.map(|b| b.len())),
            }
        }
    }
}
