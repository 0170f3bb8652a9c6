//! Reading a GGUF file: a bounds-checked parse of the header, metadata and
//! tensor descriptions over a memory map (or owned bytes).

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::Path;

use encore_ops::dtype::ggml_type_name;
use encore_ops::DType;
use memmap2::Mmap;

use super::value::{Array, Value, ValueType};
use super::{GgufError, DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};

/// Fewest bytes a metadata entry takes: key length, value type, a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;

/// Fewest bytes a tensor description takes: name length, n_dims, one
/// dimension, type, offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;

/// Vectors of variable-size items (strings, nested arrays, entries) reserve at
/// most this many slots up front and grow as items are actually read, so the
/// memory used stays proportional to the bytes parsed.
const MAX_RESERVE: usize = 4096;

/// A parsed GGUF file: metadata, tensor descriptions, and the file's bytes.
pub struct GgufFile {
    bytes: Bytes,
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u32,
    data_offset: u64,
}

/// One tensor's description; its bytes come from [`GgufFile::tensor_data`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` varies fastest (the row length).
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Bytes of data, `dtype.bytes_for(n_elements)`.
    pub n_bytes: usize,
}

enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(map) => map,
            Bytes::Owned(vec) => vec,
        }
    }
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`.
    ///
    /// The file must not be modified or truncated while the returned value
    /// is alive (as with any memory map); model files are read-only in practice.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io_error = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_error)?;
        // Opening a directory succeeds on Unix; mapping it fails with ENODEV.
        if file.metadata().map_err(io_error)?.is_dir() {
            return Err(io_error(std::io::Error::other("it is a directory")));
        }
        // SAFETY: the map is read-only and private to this value. Changing the
        // file underneath a live map is outside what this API supports (see above).
        let map = unsafe { Mmap::map(&file) }.map_err(io_error)?;
        GgufFile::parse(Bytes::Mapped(map))
    }

    /// Validates a GGUF file held in memory, with the same checks as [`GgufFile::open`].
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::parse(Bytes::Owned(bytes))
    }

    fn parse(bytes: Bytes) -> Result<GgufFile, GgufError> {
        let header = parse(bytes.as_slice())?;
        Ok(GgufFile {
            bytes,
            version: header.version,
            metadata: header.metadata,
            key_index: header.key_index,
            tensors: header.tensors,
            tensor_index: header.tensor_index,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data-section alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u32 {
        self.alignment
    }

    /// The file offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let index = *self.key_index.get(key)?;
        self.metadata.get(index).map(|(_, value)| value)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let value = self.require(key)?;
        value
            .as_str()
            .ok_or_else(|| wrong_type(key, "string", value))
    }

    /// An integer value of any integer type, if it fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        value_to_u32(key, self.require(key)?)
    }

    /// An integer value of any integer type, if it fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let value = self.require(key)?;
        let int = value
            .as_i128()
            .ok_or_else(|| wrong_type(key, "an integer", value))?;
        u64::try_from(int).map_err(|_| out_of_range(key, int, "u64"))
    }

    /// A float or integer value, as `f32`.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let value = self.require(key)?;
        match *value {
            Value::F32(v) => Ok(v),
            _ => value
                .as_f64()
                .map(|v| v as f32)
                .ok_or_else(|| wrong_type(key, "a number", value)),
        }
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            Value::Bool(v) => Ok(*v),
            other => Err(wrong_type(key, "bool", other)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        match self.require(key)? {
            Value::Array(Array::String(v)) => Ok(v.iter().map(String::as_str).collect()),
            other => Err(wrong_type(key, "array[string]", other)),
        }
    }

    /// An array of floats or integers, as `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        let value = self.require(key)?;
        match value.as_array() {
            Some(Array::F32(v)) => Ok(v.clone()),
            Some(array) => array
                .as_f64s()
                .map(|v| v.into_iter().map(|x| x as f32).collect())
                .ok_or_else(|| wrong_type(key, "an array of numbers", value)),
            None => Err(wrong_type(key, "an array of numbers", value)),
        }
    }

    /// An array of integers of any integer type whose elements all fit in `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        let value = self.require(key)?;
        match value.as_array() {
            Some(Array::I32(v)) => Ok(v.clone()),
            Some(array) => {
                let ints = array
                    .as_i128s()
                    .ok_or_else(|| wrong_type(key, "an array of integers", value))?;
                ints.into_iter()
                    .enumerate()
                    .map(|(i, x)| {
                        i32::try_from(x).map_err(|_| out_of_range(format!("{key}[{i}]"), x, "i32"))
                    })
                    .collect()
            }
            None => Err(wrong_type(key, "an array of integers", value)),
        }
    }

    /// All tensor descriptions, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .and_then(|&index| self.tensors.get(index))
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))
    }

    /// Tells the operating system that bytes `range` of a tensor's data
    /// are no longer needed, so their mapped pages leave the resident set
    /// once they have been copied elsewhere (to a device). Reading them
    /// again still works: the pages come back from the file. Does nothing
    /// for owned bytes.
    pub fn release_tensor_bytes(&self, tensor: &TensorInfo, range: std::ops::Range<usize>) {
        const PAGE: usize = 4096;
        let Bytes::Mapped(map) = &self.bytes else {
            return;
        };
        let Some(start) = usize::try_from(self.data_offset)
            .ok()
            .and_then(|d| d.checked_add(usize::try_from(tensor.offset).ok()?))
            .and_then(|s| s.checked_add(range.start))
        else {
            return;
        };
        let len = range.len().min(tensor.n_bytes.saturating_sub(range.start));
        let end = start.saturating_add(len).min(map.len());
        let first = start / PAGE * PAGE;
        if end <= first {
            return;
        }
        // SAFETY: the map is private and read-only, so discarding its pages
        // loses nothing: the next access reads them from the file again,
        // with the same contents (the file must not change while mapped,
        // as `open` already requires).
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first)
        };
    }

    /// The bytes of a tensor of this file, without copying. Bounds were
    /// checked at open; a `TensorInfo` whose range is not inside this file
    /// (one from another file, say) gets an empty slice.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        let range = self
            .data_offset
            .checked_add(tensor.offset)
            .and_then(|start| usize::try_from(start).ok())
            .and_then(|start| Some(start..start.checked_add(tensor.n_bytes)?));
        range
            .and_then(|range| self.bytes.as_slice().get(range))
            .unwrap_or(&[])
    }
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("len", &self.bytes.as_slice().len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: found.type_name(),
    }
}

fn out_of_range(key: impl Into<String>, value: i128, expected: &'static str) -> GgufError {
    GgufError::OutOfRange {
        key: key.into(),
        value: value.to_string(),
        expected,
    }
}

/// An integer metadata value as `u32`: the conversion behind
/// [`GgufFile::get_u32`], shared with the alignment lookup and the writer.
pub(super) fn value_to_u32(key: &str, value: &Value) -> Result<u32, GgufError> {
    let int = value
        .as_i128()
        .ok_or_else(|| wrong_type(key, "an integer", value))?;
    u32::try_from(int).map_err(|_| out_of_range(key, int, "u32"))
}

/// Checks a tensor's shape and returns its element and byte counts.
pub(super) fn tensor_size(
    name: &str,
    dims: &[u64],
    dtype: DType,
) -> Result<(u64, usize), GgufError> {
    let bad = |reason: String| GgufError::BadDimensions {
        tensor: name.to_owned(),
        reason,
    };
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(bad(format!(
            "{} dimensions (must be 1 to {MAX_DIMS})",
            dims.len()
        )));
    }
    let mut n_elements: u64 = 1;
    for (i, &dim) in dims.iter().enumerate() {
        if dim == 0 {
            return Err(bad(format!("dimension {i} is zero")));
        }
        n_elements = n_elements
            .checked_mul(dim)
            .filter(|&n| i64::try_from(n).is_ok())
            .ok_or_else(|| bad(format!("element count of {dims:?} overflows")))?;
    }
    let row = dims.first().copied().unwrap_or(1);
    let block = dtype.block_len() as u64;
    if row % block != 0 {
        return Err(bad(format!(
            "row length {row} is not a multiple of the {dtype} block length {block}"
        )));
    }
    let n_bytes = usize::try_from(n_elements)
        .ok()
        .and_then(|n| dtype.bytes_for(n))
        .ok_or_else(|| bad(format!("byte size of {dims:?} {dtype} overflows")))?;
    Ok((n_elements, n_bytes))
}

/// Everything [`parse`] learns from a file's bytes.
struct Header {
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u32,
    data_offset: u64,
}

fn parse(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut r = Reader { bytes, pos: 0 };

    let found = r.raw::<4>("magic")?;
    if found != MAGIC {
        return Err(GgufError::BadMagic { found });
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let tensor_count = r.count("tensor_count", MIN_TENSOR_INFO_BYTES)?;
    let kv_count = r.count("metadata_kv_count", MIN_KV_BYTES)?;

    let mut metadata = Vec::with_capacity(kv_count.min(MAX_RESERVE));
    let mut key_index = HashMap::with_capacity(kv_count.min(MAX_RESERVE));
    for i in 0..kv_count {
        let key = r
            .string("key")
            .map_err(|e| e.context(format_args!("metadata entry {i}")))?;
        let value = r
            .value()
            .map_err(|e| e.context(format_args!("metadata `{key}`")))?;
        if key_index.insert(key.clone(), i).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let mut tensors = Vec::with_capacity(tensor_count.min(MAX_RESERVE));
    let mut tensor_index = HashMap::with_capacity(tensor_count.min(MAX_RESERVE));
    for i in 0..tensor_count {
        let name = r
            .string("name")
            .map_err(|e| e.context(format_args!("tensor info {i}")))?;
        let tensor = r.tensor_info(name)?;
        if tensor_index.insert(tensor.name.clone(), i).is_some() {
            return Err(GgufError::DuplicateTensor(tensor.name));
        }
        tensors.push(tensor);
    }

    let alignment = match key_index
        .get("general.alignment")
        .and_then(|&i| metadata.get(i))
    {
        Some((key, value)) => value_to_u32(key, value)?,
        None => DEFAULT_ALIGNMENT,
    };
    if !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment(alignment));
    }
    let data_offset = r
        .offset()
        .checked_next_multiple_of(u64::from(alignment))
        .unwrap_or(u64::MAX);

    let file_len = bytes.len() as u64;
    for t in &tensors {
        if t.offset % u64::from(alignment) != 0 {
            return Err(GgufError::Misaligned {
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let start = data_offset.saturating_add(t.offset);
        let n_bytes = t.n_bytes as u64;
        if !matches!(start.checked_add(n_bytes), Some(end) if end <= file_len) {
            return Err(GgufError::TensorOutOfBounds {
                tensor: t.name.clone(),
                start,
                n_bytes,
                file_len,
            });
        }
    }

    Ok(Header {
        version,
        metadata,
        key_index,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}

/// A cursor over the file's bytes; every read checks the bytes remain.
/// Errors name the field being read; callers add where it is with
/// [`GgufError::context`].
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn truncated(&self, what: &str) -> GgufError {
        GgufError::Truncated {
            what: what.to_owned(),
            offset: self.offset(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n);
        let slice = end
            .and_then(|end| self.bytes.get(self.pos..end))
            .ok_or_else(|| self.truncated(what))?;
        self.pos += slice.len();
        Ok(slice)
    }

    fn raw<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let slice = self.take(N, what)?;
        slice.try_into().map_err(|_| self.truncated(what))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.raw(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.raw(what).map(u64::from_le_bytes)
    }

    fn bool(&mut self, what: &str) -> Result<bool, GgufError> {
        let offset = self.offset();
        let [byte] = self.raw(what)?;
        decode_bool(byte).ok_or_else(|| GgufError::InvalidBool {
            what: what.to_owned(),
            byte,
            offset,
        })
    }

    /// Reads a u64 count of items of at least `min_bytes_each` bytes,
    /// rejecting counts the rest of the file cannot hold.
    fn count(&mut self, what: &str, min_bytes_each: usize) -> Result<usize, GgufError> {
        let offset = self.offset();
        let count = self.u64(what)?;
        let max = self.remaining() / min_bytes_each.max(1);
        match usize::try_from(count) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(GgufError::TooLarge {
                what: what.to_owned(),
                count,
                max: max as u64,
                offset,
            }),
        }
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self
            .count("string length", 1)
            .map_err(|e| e.context(what))?;
        let offset = self.offset();
        let bytes = self.take(len, what)?;
        let text = std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
            what: what.to_owned(),
            offset,
        })?;
        Ok(text.to_owned())
    }

    /// Reads `count` fixed-size little-endian elements.
    fn fixed<T, const N: usize>(
        &mut self,
        count: usize,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, GgufError> {
        let n_bytes = count
            .checked_mul(N)
            .ok_or_else(|| self.truncated("array elements"))?;
        let bytes = self.take(n_bytes, "array elements")?;
        Ok(bytes
            .chunks_exact(N)
            .flat_map(<[u8; N]>::try_from)
            .map(decode)
            .collect())
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType, GgufError> {
        let offset = self.offset();
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            what: what.to_owned(),
            id,
            offset,
        })
    }

    /// Reads a value type tag and the value that follows it.
    fn value(&mut self) -> Result<Value, GgufError> {
        Ok(match self.value_type("value type")? {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.raw("u8 value")?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.raw("i8 value")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.raw("u16 value")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.raw("i16 value")?)),
            ValueType::U32 => Value::U32(self.u32("u32 value")?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.raw("i32 value")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.raw("f32 value")?)),
            ValueType::Bool => Value::Bool(self.bool("bool value")?),
            ValueType::String => Value::String(self.string("string value")?),
            ValueType::Array => Value::Array(self.array(1)?),
            ValueType::U64 => Value::U64(self.u64("u64 value")?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.raw("i64 value")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.raw("f64 value")?)),
        })
    }

    /// Reads an array's element type, count and elements; `depth` is 1 for
    /// a top-level array.
    fn array(&mut self, depth: usize) -> Result<Array, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::ArrayTooDeep {
                what: "array".to_owned(),
                max_depth: MAX_ARRAY_DEPTH,
                offset: self.offset(),
            });
        }
        let elem = self.value_type("array element type")?;
        let count = self.count("array length", elem.min_encoded_bytes())?;
        Ok(match elem {
            ValueType::U8 => Array::U8(self.fixed(count, u8::from_le_bytes)?),
            ValueType::I8 => Array::I8(self.fixed(count, i8::from_le_bytes)?),
            ValueType::U16 => Array::U16(self.fixed(count, u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(self.fixed(count, i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(self.fixed(count, u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(self.fixed(count, i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(self.fixed(count, f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(self.fixed(count, u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(self.fixed(count, i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(self.fixed(count, f64::from_le_bytes)?),
            ValueType::Bool => {
                let offset = self.offset();
                let bytes = self.take(count, "array elements")?;
                let bools = bytes.iter().enumerate().map(|(i, &byte)| {
                    decode_bool(byte).ok_or_else(|| GgufError::InvalidBool {
                        what: format!("element {i}"),
                        byte,
                        offset: offset + i as u64,
                    })
                });
                Array::Bool(bools.collect::<Result<_, _>>()?)
            }
            ValueType::String => {
                let mut strings = Vec::with_capacity(count.min(MAX_RESERVE));
                for i in 0..count {
                    let s = self
                        .string("string")
                        .map_err(|e| e.context(format_args!("element {i}")))?;
                    strings.push(s);
                }
                Array::String(strings)
            }
            ValueType::Array => {
                let mut arrays = Vec::with_capacity(count.min(MAX_RESERVE));
                for i in 0..count {
                    let a = self
                        .array(depth + 1)
                        .map_err(|e| e.context(format_args!("element {i}")))?;
                    arrays.push(a);
                }
                Array::Array(arrays)
            }
        })
    }

    /// Reads the rest of a tensor description (after its name) and checks
    /// its shape and type. Its offset is checked once the data section's
    /// start is known.
    fn tensor_info(&mut self, name: String) -> Result<TensorInfo, GgufError> {
        let n_dims = self
            .u32("n_dims")
            .map_err(|e| e.context(format_args!("tensor `{name}`")))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::BadDimensions {
                tensor: name,
                reason: format!("n_dims is {n_dims} (must be 1 to {MAX_DIMS})"),
            });
        }
        let mut dims = Vec::with_capacity(MAX_DIMS);
        for _ in 0..n_dims {
            dims.push(
                self.u64("dimension")
                    .map_err(|e| e.context(format_args!("tensor `{name}`")))?,
            );
        }
        let type_id = self
            .u32("type")
            .map_err(|e| e.context(format_args!("tensor `{name}`")))?;
        let offset = self
            .u64("offset")
            .map_err(|e| e.context(format_args!("tensor `{name}`")))?;

        let Some(dtype) = DType::from_ggml_id(type_id) else {
            return Err(GgufError::UnsupportedTensorType {
                tensor: name,
                type_name: ggml_type_name(type_id),
                id: type_id,
            });
        };
        let (n_elements, n_bytes) = tensor_size(&name, &dims, dtype)?;
        Ok(TensorInfo {
            name,
            dims,
            dtype,
            offset,
            n_elements,
            n_bytes,
        })
    }
}

fn decode_bool(byte: u8) -> Option<bool> {
    match byte {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;
    use proptest::prelude::*;

    const TOKENS: [&str; 4] = ["<unk>", "<s>", "▁hi", "!"];

    /// A small valid file: scalar and array metadata, an F32 tensor, and a
    /// Q4_1 tensor whose data ends the file.
    fn sample() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", "llama")
            .add_metadata("llama.block_count", 2u32)
            .add_metadata("llama.rope.freq_base", 10_000.0f32)
            .add_metadata("tokenizer.ggml.add_bos_token", true)
            .add_metadata("tokenizer.ggml.tokens", TOKENS.to_vec())
            .add_metadata("tokenizer.ggml.token_type", vec![2i32, 3, 1, 1])
            .add_metadata("test.negative", -1i32);
        w.add_tensor("tensor.alpha", &[4, 2], DType::F32, vec![7; 32])
            .unwrap();
        w.add_tensor("tensor.beta", &[32], DType::Q4_1, vec![9; 20])
            .unwrap();
        w.to_bytes()
    }

    fn find(bytes: &[u8], needle: &[u8]) -> usize {
        bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .unwrap()
    }

    /// The position just after a length-prefixed string `s` in `bytes`.
    fn after_string(bytes: &[u8], s: &str) -> usize {
        let mut needle = (s.len() as u64).to_le_bytes().to_vec();
        needle.extend_from_slice(s.as_bytes());
        find(bytes, &needle) + needle.len()
    }

    /// Where a tensor info's fields start.
    #[derive(Clone, Copy)]
    struct Fields {
        n_dims: usize,
        dims: usize,
        ty: usize,
        offset: usize,
    }

    fn tensor_fields(bytes: &[u8], name: &str) -> Fields {
        let n_dims_at = after_string(bytes, name);
        let n_dims = u32::from_le_bytes(bytes[n_dims_at..n_dims_at + 4].try_into().unwrap());
        let type_at = n_dims_at + 4 + 8 * n_dims as usize;
        Fields {
            n_dims: n_dims_at,
            dims: n_dims_at + 4,
            ty: type_at,
            offset: type_at + 4,
        }
    }

    fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
        bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
        bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    fn parse_err(bytes: Vec<u8>) -> GgufError {
        let err = GgufFile::from_bytes(bytes).unwrap_err();
        assert!(!err.to_string().is_empty());
        err
    }

    #[test]
    fn sample_parses() {
        let file = GgufFile::from_bytes(sample()).unwrap();
        assert_eq!(file.version(), 3);
        assert_eq!(file.alignment(), 32);
        assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(file.get_u32("llama.block_count").unwrap(), 2);
        assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), 10_000.0);
        assert!(file.get_bool("tokenizer.ggml.add_bos_token").unwrap());
        assert_eq!(file.get_str_array("tokenizer.ggml.tokens").unwrap(), TOKENS);
        assert_eq!(
            file.get_i32_array("tokenizer.ggml.token_type").unwrap(),
            [2, 3, 1, 1]
        );
        let names: Vec<_> = file.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["tensor.alpha", "tensor.beta"]);
        let beta = file.tensor("tensor.beta").unwrap();
        assert_eq!(beta.offset, 32);
        assert_eq!(file.tensor_data(beta), [9; 20]);
    }

    #[test]
    fn open_maps_the_same_file() {
        let path = std::env::temp_dir().join(format!("encore-gguf-{}.gguf", std::process::id()));
        std::fs::write(&path, sample()).unwrap();
        let mapped = GgufFile::open(&path);
        std::fs::remove_file(&path).unwrap();
        let mapped = mapped.unwrap();
        let owned = GgufFile::from_bytes(sample()).unwrap();
        assert_eq!(mapped.metadata(), owned.metadata());
        assert_eq!(mapped.tensors(), owned.tensors());
        for t in mapped.tensors() {
            assert_eq!(mapped.tensor_data(t), owned.tensor_data(t));
        }
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = GgufFile::open("/nonexistent/dir/model.gguf").unwrap_err();
        assert!(matches!(&err, GgufError::Io { path, .. } if path.ends_with("model.gguf")));
        assert!(
            err.to_string().contains("/nonexistent/dir/model.gguf"),
            "{err}"
        );
    }

    #[test]
    fn directory_is_named_as_such() {
        let err = GgufFile::open(std::env::temp_dir()).unwrap_err();
        assert!(err.to_string().ends_with(": it is a directory"), "{err}");
    }

    #[test]
    fn every_prefix_is_rejected() {
        let bytes = sample();
        for len in 0..bytes.len() {
            let err = parse_err(bytes[..len].to_vec());
            assert!(
                matches!(
                    err,
                    GgufError::Truncated { .. }
                        | GgufError::TooLarge { .. }
                        | GgufError::TensorOutOfBounds { .. }
                ),
                "prefix of {len} bytes: {err}"
            );
        }
        assert!(matches!(
            parse_err(vec![]),
            GgufError::Truncated { what, offset: 0 } if what == "magic"
        ));
    }

    #[test]
    fn wrong_magic() {
        let mut bytes = sample();
        bytes[..4].copy_from_slice(b"GGML");
        let err = parse_err(bytes);
        assert!(matches!(err, GgufError::BadMagic { found } if &found == b"GGML"));
        assert!(err.to_string().contains("\"GGML\""), "{err}");
    }

    #[test]
    fn versions_2_and_3_only() {
        let mut bytes = sample();
        put_u32(&mut bytes, 4, 2);
        assert_eq!(GgufFile::from_bytes(bytes.clone()).unwrap().version(), 2);
        for version in [0, 1, 4, 0x0300_0000] {
            put_u32(&mut bytes, 4, version);
            assert!(matches!(
                parse_err(bytes.clone()),
                GgufError::UnsupportedVersion(v) if v == version
            ));
        }
    }

    #[test]
    fn tensor_data_past_the_end() {
        let mut bytes = sample();
        bytes.pop();
        let err = parse_err(bytes);
        assert!(
            matches!(&err, GgufError::TensorOutOfBounds { tensor, n_bytes: 20, .. } if tensor == "tensor.beta"),
            "{err}"
        );

        for offset in [1 << 20, u64::MAX - 31] {
            let mut bytes = sample();
            let at = tensor_fields(&bytes, "tensor.alpha").offset;
            put_u64(&mut bytes, at, offset);
            assert!(matches!(
                parse_err(bytes),
                GgufError::TensorOutOfBounds { tensor, .. } if tensor == "tensor.alpha"
            ));
        }
    }

    #[test]
    fn misaligned_tensor_offset() {
        let mut bytes = sample();
        let at = tensor_fields(&bytes, "tensor.beta").offset;
        put_u64(&mut bytes, at, 33);
        assert!(matches!(
            parse_err(bytes),
            GgufError::Misaligned { tensor, offset: 33, alignment: 32 } if tensor == "tensor.beta"
        ));
    }

    #[test]
    fn absurd_counts_are_rejected_before_allocating() {
        let huge = 1u64 << 62;
        let expect_too_large = |bytes: Vec<u8>, field: &str| {
            let err = parse_err(bytes);
            assert!(
                matches!(&err, GgufError::TooLarge { what, count, .. } if what.contains(field) && *count == huge),
                "{err}"
            );
        };

        let mut bytes = sample();
        put_u64(&mut bytes, 8, huge);
        expect_too_large(bytes, "tensor_count");

        let mut bytes = sample();
        put_u64(&mut bytes, 16, huge);
        expect_too_large(bytes, "metadata_kv_count");

        // The first key's length.
        let mut bytes = sample();
        put_u64(&mut bytes, 24, huge);
        expect_too_large(bytes, "metadata entry 0: key: string length");

        // A string value's length.
        let mut bytes = sample();
        let at = after_string(&bytes, "general.architecture") + 4;
        put_u64(&mut bytes, at, huge);
        expect_too_large(
            bytes,
            "metadata `general.architecture`: string value: string length",
        );

        // An array's length, and one string inside it.
        let mut bytes = sample();
        let array_at = after_string(&bytes, "tokenizer.ggml.tokens") + 4;
        put_u64(&mut bytes, array_at + 4, huge);
        expect_too_large(bytes, "metadata `tokenizer.ggml.tokens`: array length");
        let mut bytes = sample();
        put_u64(&mut bytes, array_at + 12, huge);
        expect_too_large(
            bytes,
            "`tokenizer.ggml.tokens`: element 0: string: string length",
        );

        // A tensor name's length.
        let mut bytes = sample();
        let name_at = find(&bytes, b"tensor.beta") - 8;
        put_u64(&mut bytes, name_at, huge);
        expect_too_large(bytes, "tensor info 1: name: string length");
    }

    #[test]
    fn bad_dimensions() {
        type Patch = fn(&mut [u8], Fields);
        let cases: [(&str, Patch); 5] = [
            ("n_dims is 1000", |b, f| put_u32(b, f.n_dims, 1000)),
            ("n_dims is 0", |b, f| put_u32(b, f.n_dims, 0)),
            ("dimension 1 is zero", |b, f| put_u64(b, f.dims + 8, 0)),
            ("overflows", |b, f| {
                put_u64(b, f.dims, 1 << 40);
                put_u64(b, f.dims + 8, 1 << 40);
            }),
            ("overflows", |b, f| put_u64(b, f.dims, u64::MAX)),
        ];
        for (reason_part, patch) in cases {
            let mut bytes = sample();
            let fields = tensor_fields(&bytes, "tensor.alpha");
            patch(&mut bytes, fields);
            let err = parse_err(bytes);
            assert!(
                matches!(&err, GgufError::BadDimensions { tensor, reason }
                    if tensor == "tensor.alpha" && reason.contains(reason_part)),
                "{reason_part}: {err}"
            );
        }

        // A Q4_1 row of 16 weights is half a block.
        let mut bytes = sample();
        let at = tensor_fields(&bytes, "tensor.beta").dims;
        put_u64(&mut bytes, at, 16);
        let err = parse_err(bytes);
        assert!(
            matches!(&err, GgufError::BadDimensions { tensor, reason }
                if tensor == "tensor.beta" && reason.contains("block length 32")),
            "{err}"
        );

        // Q4_K rows are whole super-blocks of 256.
        let mut w = GgufWriter::new();
        w.add_tensor(
            "blk.0.ffn_down.weight",
            &[256, 2],
            DType::Q4_K,
            vec![0; 288],
        )
        .unwrap();
        let mut bytes = w.to_bytes();
        let at = tensor_fields(&bytes, "blk.0.ffn_down.weight").dims;
        put_u64(&mut bytes, at, 128);
        put_u64(&mut bytes, at + 8, 4);
        let err = parse_err(bytes);
        assert!(
            matches!(&err, GgufError::BadDimensions { reason, .. } if reason.contains("block length 256")),
            "{err}"
        );
    }

    #[test]
    fn unsupported_tensor_type_names_tensor_and_type() {
        let mut bytes = sample();
        let type_at = tensor_fields(&bytes, "tensor.beta").ty;
        put_u32(&mut bytes, type_at, 16);
        let err = parse_err(bytes.clone());
        assert!(matches!(
            &err,
            GgufError::UnsupportedTensorType { tensor, type_name: "IQ2_XXS", id: 16 } if tensor == "tensor.beta"
        ));
        let message = err.to_string();
        assert!(message.contains("tensor.beta") && message.contains("IQ2_XXS"));
        assert!(
            message.contains("Q4_K") && message.contains("IQ4_XS"),
            "{message}"
        );

        // Q8_K holds activations, never weights in a file.
        put_u32(&mut bytes, type_at, 15);
        assert!(matches!(
            parse_err(bytes.clone()),
            GgufError::UnsupportedTensorType {
                type_name: "Q8_K",
                id: 15,
                ..
            }
        ));

        put_u32(&mut bytes, type_at, 1000);
        assert!(matches!(
            parse_err(bytes),
            GgufError::UnsupportedTensorType {
                type_name: "unknown",
                id: 1000,
                ..
            }
        ));
    }

    #[test]
    fn duplicate_keys_and_tensors() {
        // Write two keys (and two tensors) of the same length, then rename
        // the second to the first.
        let mut w = GgufWriter::new();
        w.add_metadata("k.a", 1u8).add_metadata("k.b", 2u8);
        let mut dup = w.to_bytes();
        let at = find(&dup, b"k.b");
        dup[at + 2] = b'a';
        assert!(matches!(parse_err(dup), GgufError::DuplicateKey(k) if k == "k.a"));

        let mut w = GgufWriter::new();
        w.add_tensor("t.a", &[1], DType::F32, vec![0; 4]).unwrap();
        w.add_tensor("t.b", &[1], DType::F32, vec![0; 4]).unwrap();
        let mut dup = w.to_bytes();
        let at = find(&dup, b"t.b");
        dup[at + 2] = b'a';
        assert!(matches!(parse_err(dup), GgufError::DuplicateTensor(t) if t == "t.a"));
    }

    #[test]
    fn malformed_values() {
        // A key that is not UTF-8.
        let mut bytes = sample();
        let at = find(&bytes, b"llama.block_count");
        bytes[at] = 0xff;
        assert!(matches!(
            parse_err(bytes),
            GgufError::InvalidUtf8 { what, .. } if what == "metadata entry 1: key"
        ));

        // A bool that is neither 0 nor 1.
        let mut bytes = sample();
        let at = after_string(&bytes, "tokenizer.ggml.add_bos_token") + 4;
        bytes[at] = 2;
        assert!(matches!(
            parse_err(bytes),
            GgufError::InvalidBool { what, byte: 2, .. } if what.contains("add_bos_token")
        ));

        // An unknown value type, and an unknown array element type.
        let mut bytes = sample();
        let at = after_string(&bytes, "llama.block_count");
        put_u32(&mut bytes, at, 13);
        assert!(matches!(
            parse_err(bytes),
            GgufError::UnknownValueType { id: 13, what, .. } if what.contains("llama.block_count")
        ));
        let mut bytes = sample();
        let at = after_string(&bytes, "tokenizer.ggml.tokens") + 4;
        put_u32(&mut bytes, at, 99);
        assert!(matches!(
            parse_err(bytes),
            GgufError::UnknownValueType { id: 99, what, .. } if what.contains("array element type")
        ));
    }

    #[test]
    fn arrays_nest_at_most_max_depth() {
        let mut deep = Array::U8(vec![1]);
        for _ in 0..MAX_ARRAY_DEPTH {
            deep = Array::Array(vec![deep]);
        }
        let mut w = GgufWriter::new();
        w.add_metadata("deep", deep);
        assert!(matches!(
            parse_err(w.to_bytes()),
            GgufError::ArrayTooDeep { max_depth: MAX_ARRAY_DEPTH, what, .. } if what.starts_with("metadata `deep`")
        ));
    }

    #[test]
    fn bad_alignment() {
        for (value, expected) in [(Value::U32(0), 0), (Value::U32(3), 3), (Value::U8(48), 48)] {
            let mut w = GgufWriter::new();
            w.add_metadata("general.alignment", value);
            assert!(matches!(parse_err(w.to_bytes()), GgufError::BadAlignment(a) if a == expected));
        }
        let mut w = GgufWriter::new();
        w.add_metadata("general.alignment", "32");
        assert!(matches!(
            parse_err(w.to_bytes()),
            GgufError::WrongType { key, .. } if key == "general.alignment"
        ));
        let mut w = GgufWriter::new();
        w.add_metadata("general.alignment", -32i64);
        assert!(matches!(
            parse_err(w.to_bytes()),
            GgufError::OutOfRange { key, .. } if key == "general.alignment"
        ));
    }

    #[test]
    fn lookup_errors_name_the_key() {
        let file = GgufFile::from_bytes(sample()).unwrap();
        assert!(matches!(
            file.get_u32("general.architecture"),
            Err(GgufError::WrongType { key, expected: "an integer", found: "string" }) if key == "general.architecture"
        ));
        assert!(matches!(
            file.get_str("llama.block_count"),
            Err(GgufError::WrongType { key, expected: "string", found: "u32" }) if key == "llama.block_count"
        ));
        assert!(matches!(
            file.get_bool("tokenizer.ggml.tokens"),
            Err(GgufError::WrongType {
                found: "array[string]",
                ..
            })
        ));
        assert!(matches!(
            file.get_str_array("tokenizer.ggml.token_type"),
            Err(GgufError::WrongType {
                found: "array[i32]",
                ..
            })
        ));
        assert!(matches!(
            file.get_f32_array("tokenizer.ggml.tokens"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(
            file.get_u32("test.negative"),
            Err(GgufError::OutOfRange { key, value, expected: "u32" }) if key == "test.negative" && value == "-1"
        ));
        assert!(matches!(
            file.get_u64("test.negative"),
            Err(GgufError::OutOfRange { .. })
        ));
        let missing = file.get_u32("llama.context_length").unwrap_err();
        assert!(matches!(&missing, GgufError::MissingKey(k) if k == "llama.context_length"));
        assert!(missing.to_string().contains("llama.context_length"));
        assert!(matches!(
            file.tensor("output.weight"),
            Err(GgufError::MissingTensor(t)) if t == "output.weight"
        ));
    }

    #[test]
    fn files_can_be_shared_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<GgufFile>();
    }

    #[test]
    fn foreign_tensor_info_gets_no_data() {
        let file = GgufFile::from_bytes(sample()).unwrap();
        let mut t = file.tensor("tensor.beta").unwrap().clone();
        t.offset = u64::MAX;
        assert!(file.tensor_data(&t).is_empty());
        t.offset = 0;
        t.n_bytes = usize::MAX;
        assert!(file.tensor_data(&t).is_empty());
    }

    /// Checks a mutated file parses or fails cleanly, and that a file that
    /// parses can be fully read.
    fn read_everything(bytes: Vec<u8>) {
        if let Ok(file) = GgufFile::from_bytes(bytes) {
            for (key, _) in file.metadata() {
                let _ = file.get_u32(key);
                let _ = file.get_f32(key);
                let _ = file.get_str_array(key);
                let _ = file.get_i32_array(key);
                let _ = file.get_f32_array(key);
            }
            for t in file.tensors() {
                assert_eq!(file.tensor_data(t).len(), t.n_bytes);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_byte_mutations_never_panic(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in any::<Option<prop::sample::Index>>(),
        ) {
            let mut bytes = sample();
            for (at, byte) in edits {
                let at = at.index(bytes.len());
                bytes[at] = byte;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len()));
            }
            read_everything(bytes);
        }

        #[test]
        fn extreme_u64_fields_never_panic(
            at in any::<prop::sample::Index>(),
            value in prop_oneof![
                Just(0u64), Just(1), Just(u64::MAX), Just(1 << 62), Just(1 << 32), any::<u64>()
            ],
        ) {
            let mut bytes = sample();
            let at = at.index(bytes.len() - 7);
            put_u64(&mut bytes, at, value);
            read_everything(bytes);
        }
    }

    /// Reads the SmolLM2-135M Q4_1 model named by `ENCORE_TEST_MODEL`.
    #[test]
    fn real_model() {
        let Some(path) = std::env::var_os("ENCORE_TEST_MODEL") else {
            eprintln!("skipped: set ENCORE_TEST_MODEL to SmolLM2-135M-Instruct.Q4_1.gguf to run");
            return;
        };
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(file.get_u32("llama.block_count").unwrap(), 30);
        assert_eq!(file.get_u32("llama.embedding_length").unwrap(), 576);

        let count = |dtype| file.tensors().iter().filter(|t| t.dtype == dtype).count();
        assert_eq!(file.tensors().len(), 272);
        assert_eq!(count(DType::Q4_1), 210);
        assert_eq!(count(DType::F32), 61);
        assert_eq!(count(DType::Q8_0), 1);

        let embd = file.tensor("token_embd.weight").unwrap();
        assert_eq!(embd.dtype, DType::Q8_0);
        assert_eq!(embd.dims[0], 576);
        let vocab = file.get_str_array("tokenizer.ggml.tokens").unwrap().len();
        assert_eq!(embd.dims, [576, vocab as u64]);
        assert_eq!(
            file.get_i32_array("tokenizer.ggml.token_type")
                .unwrap()
                .len(),
            vocab
        );
        for t in file.tensors() {
            assert_eq!(file.tensor_data(t).len(), t.n_bytes, "{}", t.name);
        }
    }
}
