//! Every WGSL kernel, translated to Metal Shading Language as the Metal
//! backend translates it: naga parses and validates the module with the
//! capabilities its MSL writer has, then writes MSL with the backend's
//! binding map. This runs on every platform; no Apple GPU compiles the
//! result here.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use encore::backend::metal::msl::{self, SizeOf, ARGS_INDEX, SIZES_INDEX};
use encore::KernelDef;
use encore_ops::KernelSet;

/// Every kernel definition of the op layer: both kernel sets.
fn all_defs() -> Vec<KernelDef> {
    let mut defs = KernelSet::Default.defs().all();
    defs.extend(KernelSet::Exact.defs().all());
    defs
}

/// The `@compute` entry points declared in the WGSL folder, by file.
fn entry_points_on_disk() -> BTreeSet<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/wgsl");
    let mut entries = BTreeSet::new();
    for file in std::fs::read_dir(dir).unwrap() {
        let path = file.unwrap().path();
        if path.extension().is_none_or(|e| e != "wgsl") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if !line.trim_start().starts_with("@compute") {
                continue;
            }
            // The function follows on this line or the next.
            let rest = if line.contains("fn ") {
                line
            } else {
                lines.next().unwrap()
            };
            let name = rest.split("fn ").nth(1).unwrap().split('(').next().unwrap();
            entries.insert(name.trim().to_string());
        }
    }
    entries
}

#[test]
fn every_wgsl_kernel_translates_to_msl_with_the_binding_map() {
    let mut translated = BTreeSet::new();
    let mut seen_sources = BTreeSet::new();
    for def in all_defs() {
        let Some(kernel) = def.metal_impl() else {
            continue;
        };
        if !seen_sources.insert((kernel.source.clone(), kernel.entry.clone())) {
            continue;
        }
        let out = msl::translate(def.name(), &kernel.source, &kernel.entry)
            .unwrap_or_else(|e| panic!("{}: {e}", def.name()));
        let name = def.name();
        assert!(
            out.threads.iter().all(|&t| t > 0),
            "{name}: {:?}",
            out.threads
        );
        assert!(
            out.threads.iter().product::<u32>() <= 1024,
            "{name}: a threadgroup of {:?} exceeds Metal's 1024 threads",
            out.threads
        );
        assert!(
            out.source.contains(&format!("kernel void {}(", out.entry)),
            "{name}: no kernel entry point in the MSL"
        );
        assert!(
            out.source.contains(&format!("[[buffer({ARGS_INDEX})]]")),
            "{name}: argument block not at buffer {ARGS_INDEX}"
        );
        for &(binding, writes) in &out.buffers {
            let bound = format!("[[buffer({binding})]]");
            let line = out
                .source
                .lines()
                .find(|l| l.contains(&bound))
                .unwrap_or_else(|| panic!("{name}: buffer {binding} is not at index {binding}"));
            assert_eq!(
                !line.contains("const&"),
                writes,
                "{name}: buffer {binding} access: {line}"
            );
        }
        if out.sizes.is_empty() {
            assert!(!out.source.contains(&format!("[[buffer({SIZES_INDEX})]]")));
        } else {
            assert!(
                out.source.contains(&format!("[[buffer({SIZES_INDEX})]]")),
                "{name}: buffer sizes not at {SIZES_INDEX}"
            );
            for size in &out.sizes {
                if let SizeOf::Buffer(i) = size {
                    assert!(
                        out.buffers.iter().any(|b| b.0 == *i),
                        "{name}: a size for unbound buffer {i}"
                    );
                }
            }
        }
        translated.insert(kernel.entry.clone());
    }
    let on_disk = entry_points_on_disk();
    assert_eq!(on_disk.len(), 17, "{on_disk:?}");
    let missing: Vec<_> = on_disk.difference(&translated).collect();
    assert!(
        missing.is_empty(),
        "kernels no definition translates: {missing:?}"
    );
}

#[test]
fn a_kernel_that_breaks_the_convention_is_refused_by_name() {
    let def = KernelSet::Default.defs().add;
    let kernel = def.metal_impl().unwrap();
    let broken = kernel
        .source
        .replacen("@group(1) @binding(0)", "@group(3) @binding(0)", 1);
    assert_ne!(broken, kernel.source, "the argument block moved");
    let e = msl::translate("add", &broken, &kernel.entry)
        .unwrap_err()
        .to_string();
    assert!(e.contains("add") && e.contains("@group(3)"), "{e}");
}
