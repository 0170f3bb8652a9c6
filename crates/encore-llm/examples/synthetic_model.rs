//! Writes a full-size model with realistic random weights
//! (`encore_llm::synthetic`): the metadata, tensors and types of a real
//! Qwen2.5 or Llama 3 file, streamed to disk, for benchmarks on a machine
//! the real file cannot reach.
//!
//! ```text
//! synthetic_model SHAPE TYPE OUT [SEED]    e.g. qwen2.5-7b q4_k_m /tmp/q7.gguf
//! synthetic_model --list                   the shapes, and each file's size
//! ```

use std::io::{BufWriter, Write};
use std::process::ExitCode;
use std::time::Instant;

use encore_llm::synthetic::{FileType, ModelShape, SyntheticModel};

const USAGE: &str = "usage: synthetic_model SHAPE TYPE OUT [SEED]\n       synthetic_model --list";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [list] if list == "--list" => list_shapes(),
        [shape, ftype, out] => write(shape, ftype, out, "0"),
        [shape, ftype, out, seed] => write(shape, ftype, out, seed),
        _ => usage(""),
    }
}

/// Prints `why` and the usage, and fails with exit code 2.
fn usage(why: &str) -> ExitCode {
    if !why.is_empty() {
        eprintln!("synthetic_model: {why}");
    }
    eprintln!("{USAGE}");
    ExitCode::from(2)
}

fn shape_names() -> String {
    ModelShape::ALL.map(|s| s.name).join(", ")
}

fn type_names() -> String {
    FileType::ALL.map(FileType::name).join(", ")
}

fn list_shapes() -> ExitCode {
    let types = FileType::ALL;
    print!(
        "{:<22} {:>6} {:>6} {:>6} {:>6} {:>8} {:>7}",
        "shape", "layers", "hidden", "ffn", "heads", "kv_heads", "vocab"
    );
    for t in types {
        print!(" {:>16}", format!("{} bytes", t.name()));
    }
    println!();
    for shape in &ModelShape::ALL {
        print!(
            "{:<22} {:>6} {:>6} {:>6} {:>6} {:>8} {:>7}",
            shape.name,
            shape.n_layer,
            shape.n_embd,
            shape.n_ff,
            shape.n_head,
            shape.n_head_kv,
            shape.vocab
        );
        for t in types {
            match SyntheticModel::from_shape(shape, t) {
                Ok(model) => print!(" {:>16}", model.file_len()),
                Err(e) => {
                    eprintln!("synthetic_model: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        println!();
    }
    ExitCode::SUCCESS
}

fn write(shape: &str, ftype: &str, out: &str, seed: &str) -> ExitCode {
    let Some(shape) = ModelShape::named(shape) else {
        return usage(&format!(
            "unknown shape `{shape}` (known: {})",
            shape_names()
        ));
    };
    let Some(ftype) = FileType::from_name(ftype) else {
        return usage(&format!("unknown type `{ftype}` (known: {})", type_names()));
    };
    let Ok(seed) = seed.parse::<u64>() else {
        return usage(&format!("the seed `{seed}` is not a whole number"));
    };
    let model = match SyntheticModel::from_shape(shape, ftype) {
        Ok(model) => model,
        Err(e) => {
            eprintln!("synthetic_model: {e}");
            return ExitCode::FAILURE;
        }
    };
    let total = model.file_len();
    eprintln!(
        "writing {} {} ({:.2} GB, {} tensors) to {out}",
        shape.name,
        ftype.name(),
        total as f64 / 1e9,
        model.tensors().len()
    );
    let start = Instant::now();
    let written = std::fs::File::create(out).and_then(|file| {
        let mut file = BufWriter::with_capacity(8 << 20, file);
        let mut reported = 0;
        let n = model.write(seed, &mut file, |p| {
            // A line each 5% of the file, and at the end.
            let percent = p.written * 100 / p.total.max(1);
            if percent >= reported + 5 || p.index + 1 == p.tensors {
                reported = percent;
                let secs = start.elapsed().as_secs_f64();
                eprintln!(
                    "{percent:>3}%  {:>8.2} GB  {:>7.0} MB/s  {}",
                    p.written as f64 / 1e9,
                    p.written as f64 / 1e6 / secs.max(1e-9),
                    p.tensor
                );
            }
        })?;
        file.flush()?;
        Ok(n)
    });
    match written {
        Ok(n) => {
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "wrote {out}: {n} bytes in {secs:.1} s ({:.0} MB/s)",
                n as f64 / 1e6 / secs.max(1e-9)
            );
            println!("{n}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("synthetic_model: cannot write {out}: {e}");
            ExitCode::FAILURE
        }
    }
}
