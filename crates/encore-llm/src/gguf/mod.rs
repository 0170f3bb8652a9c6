//! GGUF model files: a validating reader and a small writer.
//!
//! GGUF (version 3, little-endian) is a header, metadata key/value pairs,
//! tensor descriptions, and an aligned data section holding the tensors'
//! bytes in ggml's block layouts (see [`encore_ops::dtype`]).
//!
//! [`GgufFile::open`] memory-maps the file and checks all of it before
//! returning, so everything after `open` is infallible lookups:
//!
//! - every count, length and offset is checked against the bytes that
//!   remain before anything is allocated or read, so a corrupt or hostile
//!   file yields a [`GgufError`] naming the field at fault, never a panic,
//!   an overflow or a huge allocation;
//! - strings are valid UTF-8, bools are 0 or 1, arrays nest at most
//!   [`MAX_ARRAY_DEPTH`] deep, keys and tensor names are unique;
//! - every tensor has 1 to [`MAX_DIMS`] nonzero dimensions, a supported
//!   [`DType`](encore_ops::DType), a row length that is a whole number of
//!   blocks, an aligned offset, and data that lies inside the file.
//!
//! Tensor data is never copied: [`GgufFile::tensor_data`] returns a slice of
//! the mapping, so opening a model costs only the metadata parse, and pages
//! are read from disk when first touched.
//!
//! [`GgufWriter`] builds files in memory, for tests and synthetic models.
//!
//! ```
//! use encore_llm::gguf::{GgufFile, GgufWriter};
//! use encore_ops::DType;
//!
//! # fn main() -> Result<(), encore_llm::gguf::GgufError> {
//! let mut writer = GgufWriter::new();
//! writer.add_metadata("llama.block_count", 2u32);
//! writer.add_tensor("output_norm.weight", &[4], DType::F32, vec![0; 16])?;
//!
//! let file = GgufFile::from_bytes(writer.to_bytes())?;
//! assert_eq!(file.get_u32("llama.block_count")?, 2);
//! let norm = file.tensor("output_norm.weight")?;
//! assert_eq!(norm.dims, [4]);
//! assert_eq!(file.tensor_data(norm).len(), 16);
//! # Ok(())
//! # }
//! ```

mod reader;
mod value;
mod writer;

use std::fmt;
use std::io;
use std::path::PathBuf;

pub use reader::{GgufFile, TensorInfo};
pub use value::{Array, Value};
pub use writer::GgufWriter;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// The data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// The most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// The deepest nesting of metadata arrays the reader accepts; an array of
/// scalars has depth 1.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Why a GGUF file could not be read, or a metadata lookup failed.
///
/// Errors about the file's structure carry `what` (the field being read,
/// e.g. ``metadata `tokenizer.ggml.tokens`: element 7: string length``) and
/// the byte offset where it starts.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read GGUF file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "not a GGUF file: it starts with {} instead of \"GGUF\"",
        ShowBytes(found)
    )]
    BadMagic { found: [u8; 4] },

    #[error("unsupported GGUF version {0} (Encore reads little-endian versions 2 and 3)")]
    UnsupportedVersion(u32),

    #[error("file ends inside {what} (offset {offset})")]
    Truncated { what: String, offset: u64 },

    #[error(
        "{what} is {count}, but the rest of the file can hold at most {max} (offset {offset})"
    )]
    TooLarge {
        what: String,
        count: u64,
        max: u64,
        offset: u64,
    },

    #[error("{what} is not valid UTF-8 (offset {offset})")]
    InvalidUtf8 { what: String, offset: u64 },

    #[error("{what} is {byte}, but a bool must be 0 or 1 (offset {offset})")]
    InvalidBool { what: String, byte: u8, offset: u64 },

    #[error("{what} is {id}, which is not a GGUF value type (offset {offset})")]
    UnknownValueType { what: String, id: u32, offset: u64 },

    #[error("{what} nests more than {max_depth} arrays deep (offset {offset})")]
    ArrayTooDeep {
        what: String,
        max_depth: usize,
        offset: u64,
    },

    #[error("metadata key `{0}` appears more than once")]
    DuplicateKey(String),

    #[error("metadata key `{0}` is missing")]
    MissingKey(String),

    #[error("metadata `{key}` is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },

    #[error("metadata `{key}` = {value} does not fit in {expected}")]
    OutOfRange {
        key: String,
        value: String,
        expected: &'static str,
    },

    #[error("general.alignment = {0} is not a nonzero power of two")]
    BadAlignment(u32),

    #[error("tensor `{0}` appears more than once")]
    DuplicateTensor(String),

    #[error("tensor `{0}` is missing")]
    MissingTensor(String),

    #[error(
        "tensor `{tensor}` has type {type_name} (ggml type {id}), which Encore does not support \
         (supported: {})",
        supported_types()
    )]
    UnsupportedTensorType {
        tensor: String,
        type_name: &'static str,
        id: u32,
    },

    #[error("tensor `{tensor}` has bad dimensions: {reason}")]
    BadDimensions { tensor: String, reason: String },

    #[error("tensor `{tensor}` has offset {offset}, which is not a multiple of the alignment {alignment}")]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u32,
    },

    #[error(
        "tensor `{tensor}` has {n_bytes} bytes of data at file offset {start}, \
         past the end of the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        n_bytes: u64,
        file_len: u64,
    },

    #[error("tensor `{tensor}` needs {expected} bytes of data, got {found}")]
    TensorSizeMismatch {
        tensor: String,
        expected: usize,
        found: usize,
    },
}

impl GgufError {
    /// Prefixes the `what` of a structural error with where it happened, so
    /// the innermost reader says "string length" and its callers add
    /// "metadata `general.name`".
    fn context(mut self, outer: impl fmt::Display) -> GgufError {
        match &mut self {
            GgufError::Truncated { what, .. }
            | GgufError::TooLarge { what, .. }
            | GgufError::InvalidUtf8 { what, .. }
            | GgufError::InvalidBool { what, .. }
            | GgufError::UnknownValueType { what, .. }
            | GgufError::ArrayTooDeep { what, .. } => *what = format!("{outer}: {what}"),
            _ => {}
        }
        self
    }
}

/// Shows bytes as text where printable, escaped otherwise: `"GGML"`, `"\x00\x01.."`.
struct ShowBytes<'a>(&'a [u8]);

impl fmt::Display for ShowBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.0.escape_ascii())
    }
}

/// The names of the tensor types Encore reads, for error messages.
fn supported_types() -> String {
    encore_ops::DType::ALL
        .map(encore_ops::DType::name)
        .join(", ")
}
