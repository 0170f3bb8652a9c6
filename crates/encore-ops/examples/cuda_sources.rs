//! Writes the full CUDA source of every kernel (runtime prelude included)
//! to a directory, one `<name>.cu` a kernel and `<name>-exact.cu` for each
//! exact version ([`encore_ops::KernelSet::Exact`]) that differs, and its compile
//! options, one a line, to `<name>.options` where it has any, for
//! inspecting what NVRTC makes of it without a GPU (`scripts/kernel-info.sh`
//! compiles one and reports its registers, stack and instructions).
//!
//! ```text
//! cargo run -p encore-ops --example cuda_sources -- target/cuda-sources
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/cuda-sources".into()),
    );
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let default = encore_ops::KernelSet::Default.defs().all();
    let exact = encore_ops::KernelSet::Exact.defs().all();
    for (def, suffix) in default
        .iter()
        .map(|d| (d, ""))
        .chain(exact.iter().map(|d| (d, "-exact")))
    {
        let Some(cuda) = def.cuda_impl() else {
            continue;
        };
        let same_as_default = default.iter().any(|d| {
            d.name() == def.name() && d.cuda_impl().map(|c| &c.source) == Some(&cuda.source)
        });
        if !suffix.is_empty() && same_as_default {
            continue;
        }
        let path = dir.join(format!("{}{suffix}.cu", def.name()));
        if let Err(e) = std::fs::write(&path, &cuda.source) {
            eprintln!("cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        let options = dir.join(format!("{}{suffix}.options", def.name()));
        let written = if def.options().is_empty() {
            match std::fs::remove_file(&options) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        } else {
            std::fs::write(&options, def.options().join("\n") + "\n")
        };
        if let Err(e) = written {
            eprintln!("cannot write {}: {e}", options.display());
            return ExitCode::FAILURE;
        }
        println!("{} (entry {})", path.display(), cuda.entry);
    }
    ExitCode::SUCCESS
}
