//! Metal Shading Language from WGSL kernels, by naga.
//!
//! The Metal backend runs the same WGSL kernels as wgpu, so one body of
//! kernel code serves both and the wgpu suites check its arithmetic on any
//! GPU. naga parses and validates the WGSL (with the capabilities its MSL
//! writer supports) and writes MSL for the kernel's entry point, which the
//! backend compiles with `newLibraryWithSource`. This module runs on every
//! platform, so the translation of every kernel is tested where no Apple
//! GPU exists.
//!
//! # The binding map
//!
//! WGSL kernels follow the binding convention of [`crate::WgpuKernel`];
//! their bindings become Metal buffer argument-table indices thus, the
//! same for every kernel:
//!
//! | WGSL | Metal | what |
//! | --- | --- | --- |
//! | `@group(0) @binding(i)`, `i` below [`WGSL_MAX_BUFFERS`] | `[[buffer(i)]]` | buffer argument `i` |
//! | `@group(1) @binding(0)` | `[[buffer(16)]]` ([`ARGS_INDEX`]) | the argument block: offsets and value |
//! | (naga's `_mslBufferSizes`) | `[[buffer(17)]]` ([`SIZES_INDEX`]) | the byte size of each binding that holds a runtime-sized array |
//!
//! Any other binding is refused with [`Error::Compile`]. The sizes let the
//! generated code check every buffer index (reads past a binding give zero,
//! writes past it are dropped), as wgpu's translation does, so a kernel
//! behaves on Metal as it does there. [`Msl::sizes`] lists what each word
//! of that buffer holds, in naga's order (global declaration order).

use naga::back::msl;

use crate::backend::wgsl::WGSL_MAX_BUFFERS;
use crate::error::{Error, Result};

/// The Metal buffer index of the argument block (`@group(1) @binding(0)`).
pub const ARGS_INDEX: usize = WGSL_MAX_BUFFERS;
/// The Metal buffer index of the binding sizes the bounds checks read.
pub const SIZES_INDEX: usize = WGSL_MAX_BUFFERS + 1;
/// The Metal Shading Language version the translation targets (macOS 12,
/// iOS 15): atomics, `simdgroup` barriers and everything the kernels use.
pub const LANGUAGE_VERSION: (u8, u8) = (2, 4);

/// What one word of the sizes buffer ([`SIZES_INDEX`]) holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeOf {
    /// The bytes bound for buffer argument `i` (from its binding's start).
    Buffer(u32),
    /// The bytes of the argument block.
    Args,
}

/// A kernel translated to MSL.
#[derive(Clone, Debug)]
pub struct Msl {
    /// The MSL source.
    pub source: String,
    /// The entry point's name in `source` (naga may rename it).
    pub entry: String,
    /// The threadgroup size (the WGSL `@workgroup_size`).
    pub threads: [u32; 3],
    /// The buffer arguments the kernel binds, `(index, writes)`, ascending.
    pub buffers: Vec<(u32, bool)>,
    /// What each word of the sizes buffer holds, in order; empty when the
    /// kernel has no runtime-sized array (then nothing is bound there).
    pub sizes: Vec<SizeOf>,
}

/// Translates the WGSL kernel `name` (full source, `@compute` entry point
/// `entry`) to MSL with the binding map of the module docs. Parse,
/// validation and translation errors are [`Error::Compile`], naming the
/// kernel.
pub fn translate(name: &str, wgsl: &str, entry: &str) -> Result<Msl> {
    let fail = |log: String| Error::Compile {
        kernel: name.to_string(),
        log,
    };
    let module = naga::front::wgsl::parse_str(wgsl).map_err(|e| fail(e.emit_to_string(wgsl)))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        msl::supported_capabilities(),
    )
    .validate(&module)
    .map_err(|e| fail(e.emit_to_string(wgsl)))?;
    let point = module
        .entry_points
        .iter()
        .find(|p| p.name == entry && p.stage == naga::ShaderStage::Compute)
        .ok_or_else(|| fail(format!("no @compute entry point `{entry}`")))?;

    let mut resources = msl::BindingMap::new();
    let mut buffers = Vec::new();
    let mut sizes = Vec::new();
    for (_, var) in module.global_variables.iter() {
        let Some(binding) = &var.binding else {
            continue;
        };
        let writes = match var.space {
            naga::AddressSpace::Storage { access } => access.contains(naga::StorageAccess::STORE),
            _ => {
                return Err(fail(format!(
                    "@group({}) @binding({}) is not a storage buffer",
                    binding.group, binding.binding
                )))
            }
        };
        let slot = match (binding.group, binding.binding as usize) {
            (0, i) if i < WGSL_MAX_BUFFERS => {
                buffers.push((binding.binding, writes));
                i
            }
            (1, 0) => ARGS_INDEX,
            (group, binding) => {
                return Err(fail(format!(
                    "binding @group({group}) @binding({binding}) is outside the convention \
                     (group 0: buffers 0..{WGSL_MAX_BUFFERS}; group 1: the argument block)"
                )))
            }
        };
        if module.types[var.ty]
            .inner
            .needs_host_buffer_byte_size(&module.types)
        {
            sizes.push(if slot == ARGS_INDEX {
                SizeOf::Args
            } else {
                SizeOf::Buffer(binding.binding)
            });
        }
        resources.insert(
            *binding,
            msl::BindTarget {
                buffer: Some(slot as msl::Slot),
                mutable: writes,
                ..msl::BindTarget::default()
            },
        );
    }
    buffers.sort_unstable();
    buffers.dedup_by_key(|b| b.0);

    let options = msl::Options {
        lang_version: LANGUAGE_VERSION,
        per_entry_point_map: [(
            entry.to_string(),
            msl::EntryPointResources {
                resources,
                immediates_buffer: None,
                sizes_buffer: Some(SIZES_INDEX as msl::Slot),
            },
        )]
        .into_iter()
        .collect(),
        // A binding outside the map is an error, not invalid MSL.
        fake_missing_bindings: false,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: naga::proc::BoundsCheckPolicy::Restrict,
            buffer: naga::proc::BoundsCheckPolicy::ReadZeroSkipWrite,
            image_load: naga::proc::BoundsCheckPolicy::ReadZeroSkipWrite,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        // Kernels initialize the workgroup memory they read (as on wgpu).
        zero_initialize_workgroup_memory: false,
        ..msl::Options::default()
    };
    let pipeline = msl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, entry.to_string())),
        ..msl::PipelineOptions::default()
    };
    let (source, translation) = msl::write_string(&module, &info, &options, &pipeline)
        .map_err(|e| fail(format!("MSL generation: {e}")))?;
    let index = module
        .entry_points
        .iter()
        .position(|p| p.name == entry && p.stage == naga::ShaderStage::Compute);
    let translated = index
        .and_then(|i| translation.entry_point_names.into_iter().nth(i))
        .ok_or_else(|| fail(format!("naga wrote no entry point `{entry}`")))?
        .map_err(|e| fail(format!("MSL generation of `{entry}`: {e}")))?;
    Ok(Msl {
        source,
        entry: translated,
        threads: point.workgroup_size,
        buffers,
        sizes,
    })
}

/// The bytes of the sizes buffer for one dispatch: each word of
/// [`Msl::sizes`] from `bound` (the bytes bound for buffer argument `i`,
/// `None` for one not bound) and `args` (the argument block's bytes).
pub fn sizes_words(sizes: &[SizeOf], bound: impl Fn(u32) -> Option<u64>, args: u64) -> Vec<u32> {
    sizes
        .iter()
        .map(|s| {
            let bytes = match *s {
                SizeOf::Buffer(i) => bound(i).unwrap_or(0),
                SizeOf::Args => args,
            };
            u32::try_from(bytes).unwrap_or(u32::MAX)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAXPY: &str = "
struct Args { off: array<u32, 16>, n: u32, a: f32 }
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(1) @binding(0) var<storage, read> args: Args;
@compute @workgroup_size(64, 2)
fn saxpy(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < args.n {
        y[args.off[2] + id.x] += args.a * x[args.off[0] + id.x];
    }
}
";

    #[test]
    fn bindings_map_to_fixed_buffer_indices() {
        let msl = translate("saxpy", SAXPY, "saxpy").unwrap();
        assert_eq!(msl.threads, [64, 2, 1]);
        assert_eq!(msl.buffers, [(0, false), (2, true)]);
        assert_eq!(msl.sizes, [SizeOf::Buffer(0), SizeOf::Buffer(2)]);
        // Read-only arguments are `const`, written ones not; the argument
        // block and the sizes sit at their fixed indices.
        for binding in [
            "const& x [[buffer(0)]]",
            "& y [[buffer(2)]]",
            "Args const& args [[buffer(16)]]",
            "_mslBufferSizes& _buffer_sizes [[buffer(17)]]",
        ] {
            assert!(
                msl.source.contains(binding),
                "{binding} missing:\n{}",
                msl.source
            );
        }
        assert!(!msl.source.contains("const& y"), "{}", msl.source);
        assert!(msl.source.contains(&format!("kernel void {}(", msl.entry)));
    }

    #[test]
    fn bindings_outside_the_convention_and_bad_entries_are_compile_errors() {
        let stray = SAXPY.replace("@group(0) @binding(2)", "@group(2) @binding(0)");
        let e = translate("stray", &stray, "saxpy").unwrap_err().to_string();
        assert!(e.contains("stray") && e.contains("@group(2)"), "{e}");
        let e = translate("saxpy", SAXPY, "main").unwrap_err().to_string();
        assert!(e.contains("`main`"), "{e}");
        let e = translate("bad", "fn (", "main").unwrap_err().to_string();
        assert!(e.contains("compiling kernel bad"), "{e}");
    }

    #[test]
    fn size_words_follow_the_sizes_order() {
        let sizes = [SizeOf::Buffer(2), SizeOf::Args, SizeOf::Buffer(0)];
        let bound = |i| (i == 2).then_some(4096u64);
        assert_eq!(sizes_words(&sizes, bound, 80), [4096, 80, 0]);
        assert_eq!(sizes_words(&[SizeOf::Args], |_| None, 1 << 40), [u32::MAX]);
    }
}
