//! Writes the full CUDA source of every kernel (runtime prelude included)
//! to a directory, one `<name>.cu` a kernel, and its compile options, one a
//! line, to `<name>.options` where it has any, for inspecting what NVRTC
//! makes of it without a GPU (`scripts/kernel-info.sh` compiles one and
//! reports its registers, stack and instructions).
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
    for def in encore_ops::kernels::all() {
        let Some(cuda) = def.cuda_impl() else {
            continue;
        };
        let path = dir.join(format!("{}.cu", def.name()));
        if let Err(e) = std::fs::write(&path, &cuda.source) {
            eprintln!("cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        let options = dir.join(format!("{}.options", def.name()));
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
