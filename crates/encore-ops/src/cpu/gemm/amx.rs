//! Products of several activation rows for the super-block types on AMX
//! (Intel's Advanced Matrix Extensions: 16 × 16 tiles of 32-bit sums, each
//! `tdpbusd` multiplying 16 rows of unsigned bytes with 16 columns of signed
//! ones), where the CPU has AMX-INT8 and Linux grants the process the tile
//! state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); the AVX-512 VNNI tiles of the
//! parent module otherwise, or with `ENCORE_AMX=0`.
//!
//! The weights are unpacked as for the VNNI tiles ([`WeightPair`]: codes
//! `c + 128`, a scale per group of 16, offsets apart), 16 rows at a time; a
//! tile's A operand is 16 weight rows' codes of one group, read in place.
//! The activations (Q8_K) are laid out once per product, 16 rows at a time,
//! as the B operand each group takes: four rows of 64 bytes, row `k` holding
//! bytes `4k..4k + 4` of the group for each activation row. One `tdpbusd`
//! then gives the 256 integer sums `Σ (c + 128) q` of one group; less
//! `128 Σ q` (from the activations' group sums) they are the exact `Σ c q`,
//! which are scaled by the weights' group scale and added into f32 lanes,
//! one per activation row; each super-block's lanes are scaled by the
//! activations' `d` as it ends, and the offsets' products `offset Σ x` join
//! group by group. So each group's products are summed in integers over all
//! 16 positions before any rounding, where the VNNI tiles round after every
//! four: the results differ from theirs (and from the dot products') in the
//! order of the float additions, as theirs do from the dot products'.
//!
//! The instructions are written as inline assembly: Rust has no stable AMX
//! intrinsics. AMX needs Linux on x86-64; elsewhere [`detect`] finds none.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::super::kquant::SUPER;
use super::super::quant::QuantizedActivations;
use super::{unpack_row, with_scratch, Rows, WeightPair, PAIR};
use crate::DType;

/// Rows of a tile: weight rows (A), activation rows (B's columns).
const TILE: usize = 16;
/// Positions of a group: one `tdpbusd`'s depth.
const GROUP: usize = 16;
/// Groups of a super-block.
const GROUPS_PER_SUPER: usize = SUPER / GROUP;

/// Evidence that this process may run AMX-INT8 instructions: the CPU has
/// AMX-TILE and AMX-INT8 and the kernel granted the tile data state. Only
/// [`detect`] makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AmxProof(());

/// AMX, where this CPU and kernel allow it and `ENCORE_AMX` is not `0`;
/// checked once per process.
pub(crate) fn detect() -> Option<AmxProof> {
    static AMX: OnceLock<bool> = OnceLock::new();
    let on = *AMX.get_or_init(|| {
        std::env::var_os("ENCORE_AMX").is_none_or(|v| v != "0") && cpu_has_amx() && request_tiles()
    });
    on.then_some(AmxProof(()))
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25), and the
/// AVX-512 the epilogue takes.
fn cpu_has_amx() -> bool {
    let leaf = __cpuid_count(7, 0);
    leaf.edx >> 24 & 1 == 1
        && leaf.edx >> 25 & 1 == 1
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`), without which the first tile instruction faults.
#[cfg(target_os = "linux")]
fn request_tiles() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the arch_prctl system call with this request only changes
    // which register states the process may use; it reads no memory.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tiles() -> bool {
    false
}

/// The tile configuration: palette 1; tiles 0 and 3 the sums (16 rows of
/// 16 i32), 1 and 4 the weights (16 rows of 16 bytes), 2 and 5 the
/// activations (4 rows of 64 bytes).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut set = |t: usize, rows: u8, bytes: u16| {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
            c[48 + t] = rows;
        };
        for base in [0, 3] {
            set(base, TILE as u8, 64);
            set(base + 1, TILE as u8, GROUP as u16);
            set(base + 2, (GROUP / 4) as u8, 64);
        }
        TileConfig(c)
    }
}

/// The activations of one product as B operands, 16 rows a tile.
#[derive(Default)]
struct Activations {
    /// `[tile][group]`: 4 rows of 64 bytes, row `k`, bytes `4n..4n + 4` =
    /// activation row `n`'s bytes `4k..4k + 4` of the group.
    b: Vec<[i8; 256]>,
    /// `[tile][group]`: `128 Σ q` of each activation row's group.
    bias: Vec<[i32; TILE]>,
    /// `[tile][super-block]`: each activation row's `d`.
    d: Vec<[f32; TILE]>,
    /// `[tile][group]`: each activation row's `d Σ q` (with offsets only).
    sums: Vec<[f32; TILE]>,
    groups: usize,
}

impl Activations {
    /// The memory the buffers hold.
    fn bytes(&self) -> usize {
        self.b.capacity() * 256
            + (self.bias.capacity() + self.d.capacity() + self.sums.capacity()) * 4 * TILE
    }

    fn pack(&mut self, x: &QuantizedActivations, offsets: bool) {
        let supers = x.cols() / SUPER;
        let groups = supers * GROUPS_PER_SUPER;
        let tiles = x.rows().div_ceil(TILE);
        self.groups = groups;
        self.b.clear();
        self.b.resize(tiles * groups, [0; 256]);
        self.bias.clear();
        self.bias.resize(tiles * groups, [0; TILE]);
        self.d.clear();
        self.d.resize(tiles * supers, [0.0; TILE]);
        self.sums.clear();
        self.sums
            .resize(if offsets { tiles * groups } else { 0 }, [0.0; TILE]);
        for (r, row) in x.super_blocks().chunks(supers.max(1)).enumerate() {
            let (t, n) = (r / TILE, r % TILE);
            for (s, block) in row.iter().enumerate() {
                self.d[t * supers + s][n] = block.d;
                for g in 0..GROUPS_PER_SUPER {
                    let at = t * groups + s * GROUPS_PER_SUPER + g;
                    let q = &block.qs[GROUP * g..GROUP * (g + 1)];
                    for k in 0..GROUP / 4 {
                        self.b[at][64 * k + 4 * n..64 * k + 4 * n + 4]
                            .copy_from_slice(&q[4 * k..4 * k + 4]);
                    }
                    let sum = block.bsums[g];
                    self.bias[at][n] = 128 * i32::from(sum);
                    if offsets {
                        self.sums[at][n] = block.d * f32::from(sum);
                    }
                }
            }
        }
    }
}

thread_local! {
    static ACTIVATIONS: RefCell<Activations> = RefCell::new(Activations::default());
    static WEIGHTS: RefCell<Rows<WeightPair>> = RefCell::new(Rows::default());
}

/// `f` on this thread's packed activations, or on fresh ones if they are in
/// use (as the parent module's `with_scratch`).
fn with_activations(f: impl FnOnce(&mut Activations)) {
    let mut f = Some(f);
    let _ = ACTIVATIONS.try_with(|cell| {
        if let (Ok(mut acts), Some(f)) = (cell.try_borrow_mut(), f.take()) {
            f(&mut acts);
        }
    });
    if let Some(f) = f {
        f(&mut Activations::default());
    }
}

/// `y = x · Wᵀ` as the parent module's `multiply`, on AMX.
pub(crate) fn multiply(
    proof: AmxProof,
    dtype: DType,
    weights: &[u8],
    rows: usize,
    x: &QuantizedActivations,
    y: &mut [f32],
) {
    let supers = x.cols() / SUPER;
    let m = x.rows();
    if supers == 0 {
        y.fill(0.0); // empty dot products
        return;
    }
    let offsets = super::has_offset(dtype);
    with_activations(|acts| {
        acts.pack(x, offsets);
        let row_bytes = weights.len().checked_div(rows).unwrap_or(0);
        super::super::tasks::for_each_task(weights, row_bytes, m, y, |w, out| {
            with_scratch(&WEIGHTS, |unpacked| {
                // SAFETY: AMX is granted (the proof); `acts` holds the
                // activations of `out`'s rows; AMX CPUs have AVX-512.
                unsafe { multiply_task(proof, dtype, w, row_bytes, acts, unpacked, out) }
            });
        });
        // As the parent module's buffers: a long prompt's are not kept.
        if acts.bytes() > super::KEEP_BYTES {
            *acts = Activations::default();
        }
    });
}

/// One task's weight rows `w` against all of `acts`, 16 rows unpacked at a time.
///
/// # Safety
/// AMX must be granted and the CPU must have AVX-512 F, BW and VNNI; `acts`
/// must hold the activation rows of `out`, packed for `dtype`'s offsets.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn multiply_task(
    _proof: AmxProof,
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &Activations,
    unpacked: &mut Rows<WeightPair>,
    out: &mut [&mut [f32]],
) {
    let pairs = acts.groups * GROUP / PAIR;
    let offsets = !acts.sums.is_empty();
    let task_rows = w.len().checked_div(row_bytes).unwrap_or(0);
    let config = TileConfig::new();
    // SAFETY: a valid palette-1 configuration; AMX is granted.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    // Always a whole tile of rows: the last tile's rows past its count are zero.
    unpacked.reset(TILE, pairs, offsets);
    let mut first = 0;
    while first < task_rows {
        let count = TILE.min(task_rows - first);
        if count < TILE {
            unpacked.reset(TILE, pairs, offsets);
        }
        for r in 0..count {
            let at = (first + r) * row_bytes;
            let (codes, offs) = unpacked.row_mut(r);
            unpack_row(dtype, &w[at..at + row_bytes], codes, offs);
        }
        for t in 0..out.len().div_ceil(TILE) {
            // SAFETY: `unpacked` holds a whole tile of rows; `acts` holds tile `t`.
            let sums = unsafe { tile(unpacked, acts, t, offsets) };
            for (n, row) in out.iter_mut().skip(TILE * t).take(TILE).enumerate() {
                for (i, s) in sums.iter().take(count).enumerate() {
                    if let Some(y) = row.get_mut(first + i) {
                        *y = s[n];
                    }
                }
            }
        }
        first += count;
    }
    // SAFETY: releases the tile state this thread configured.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The products of the 16 unpacked weight rows with activation tile `t`:
/// `[i][n]` is weight row `i` against activation row `16 t + n`.
///
/// # Safety
/// Tiles must be configured ([`TileConfig`]) and the CPU must have AVX-512
/// F and BW; `w` must hold 16 rows of the activations' pairs (and their
/// offsets if `offsets`).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile(
    w: &Rows<WeightPair>,
    acts: &Activations,
    t: usize,
    offsets: bool,
) -> [[f32; TILE]; TILE] {
    let groups = acts.groups;
    let supers = groups / GROUPS_PER_SUPER;
    let stride = w.width * size_of::<WeightPair>();
    let base = w.row_ptr(0).0.cast::<u8>();
    #[repr(C, align(64))]
    struct Sums([[i32; TILE]; 2 * TILE]);
    let mut c = Sums([[0; TILE]; 2 * TILE]);
    let c0 = c.0.as_mut_ptr();
    // SAFETY: the second tile's rows start 16 rows on, within `c`.
    let c1 = unsafe { c0.add(TILE) };
    let mut acc = [_mm512_setzero_ps(); TILE];
    for s in 0..supers {
        let mut part = [_mm512_setzero_ps(); TILE];
        for g2 in (0..GROUPS_PER_SUPER).step_by(2) {
            let g = s * GROUPS_PER_SUPER + g2;
            // Group g's codes: pair g / 4, bytes 16 (g % 4).., of each row.
            let a = |g: usize| {
                // SAFETY: within the first row's pairs; the tile rows follow at `stride`.
                unsafe { base.add((g / 4) * size_of::<WeightPair>() + GROUP * (g % 4)) }
            };
            let b = |g: usize| acts.b[t * groups + g].as_ptr();
            // SAFETY: the operands lie within `w` and `acts` as the
            // configuration reads them; `c` takes two tiles of sums.
            unsafe {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm3",
                    "tileloadd tmm1, [{a0} + {sa}*1]",
                    "tileloadd tmm2, [{b0} + {sb}*1]",
                    "tdpbusd tmm0, tmm1, tmm2",
                    "tileloadd tmm4, [{a1} + {sa}*1]",
                    "tileloadd tmm5, [{b1} + {sb}*1]",
                    "tdpbusd tmm3, tmm4, tmm5",
                    "tilestored [{c0} + {sb}*1], tmm0",
                    "tilestored [{c1} + {sb}*1], tmm3",
                    a0 = in(reg) a(g),
                    a1 = in(reg) a(g + 1),
                    b0 = in(reg) b(g),
                    b1 = in(reg) b(g + 1),
                    c0 = in(reg) c0,
                    c1 = in(reg) c1,
                    sa = in(reg) stride,
                    sb = in(reg) 64usize,
                    options(nostack),
                );
            }
            for h in 0..2 {
                let g = g + h;
                // SAFETY: 16 readable lanes each; the loads are unaligned.
                let (bias, sums) = unsafe {
                    (
                        _mm512_loadu_si512(acts.bias[t * groups + g].as_ptr().cast()),
                        offsets.then(|| _mm512_loadu_ps(acts.sums[t * groups + g].as_ptr())),
                    )
                };
                for (i, p) in part.iter_mut().enumerate() {
                    let row = w.row_ptr(i);
                    // SAFETY: pair g / 4 of row i and its group offsets exist.
                    let (scale, offset) = unsafe {
                        let pair = &*row.0.add(g / 4);
                        (
                            pair.scale[4 * (g % 4)],
                            if offsets { *row.1.add(g) } else { 0.0 },
                        )
                    };
                    // SAFETY: a 64-byte-aligned row of 16 sums within `c`.
                    let sum = unsafe { _mm512_load_si512(c0.add(TILE * h + i).cast()) };
                    let dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, bias));
                    *p = _mm512_fmadd_ps(dot, _mm512_set1_ps(scale), *p);
                    if let Some(sums) = sums {
                        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(offset), sums, acc[i]);
                    }
                }
            }
        }
        // SAFETY: 16 readable lanes; the load is unaligned.
        let d = unsafe { _mm512_loadu_ps(acts.d[t * supers + s].as_ptr()) };
        for (a, p) in acc.iter_mut().zip(part) {
            *a = _mm512_fmadd_ps(p, d, *a);
        }
    }
    let mut out = [[0.0; TILE]; TILE];
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: 16 writable lanes; the store is unaligned.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
    }
    out
}
