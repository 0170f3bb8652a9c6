//! Writes a model with a template's metadata, tensor names, shapes and types
//! and random weights (`encore_llm::synthetic::synthetic_like`): speed on it
//! equals speed on the real weights, and only the template's header is
//! read, so a sparse file of the template's size will do. It is how the GPU
//! scripts make the catalog models' shapes on a machine the real files are
//! too large to reach: `cargo run --release --example synthetic_like --
//! TEMPLATE OUT [SEED]`.

use encore_llm::gguf::GgufFile;
use encore_llm::synthetic::synthetic_like;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(template), Some(out)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: synthetic_like TEMPLATE OUT [SEED]");
        std::process::exit(2);
    };
    let seed = match args.get(3) {
        Some(s) => s.parse()?,
        None => 3,
    };
    let bytes = synthetic_like(&GgufFile::open(template)?, seed);
    std::fs::write(out, bytes)?;
    Ok(())
}
