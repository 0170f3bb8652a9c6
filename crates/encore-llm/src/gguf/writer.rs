//! Writing GGUF v3 files: in memory for tests, or streamed for files too
//! large to hold (a tensor's data may be written by the caller as the file
//! is written).

use std::io::{self, Write};

use encore_ops::DType;

use super::reader::{tensor_size, value_to_u32};
use super::value::{Array, Value};
use super::{GgufError, DEFAULT_ALIGNMENT, MAGIC};

/// Builds a GGUF v3 file.
///
/// Metadata and tensors are written in the order they are added. Tensor data
/// is laid out at multiples of `general.alignment` (32 unless set), with the
/// last tensor's data ending the file.
///
/// A tensor added with [`GgufWriter::add_tensor`] carries its bytes; one
/// added with [`GgufWriter::add_tensor_info`] has only its name, shape and
/// type, and [`GgufWriter::write_to`] asks the caller for its bytes when
/// their turn comes, so a file of any size is written without holding it.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    dtype: DType,
    n_bytes: usize,
    /// `None` for a tensor whose data the caller streams.
    data: Option<Vec<u8>>,
}

impl GgufWriter {
    /// An empty file: no metadata, no tensors.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata entry, or replaces the value of an existing key in place.
    ///
    /// Values are written as given, so a test can set `general.alignment`
    /// to a value the reader rejects; the data is then laid out at the
    /// default alignment.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut Self {
        let key = key.into();
        let value = value.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some((_, existing)) => *existing = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    /// Adds a tensor. `dims` are in ggml order (row length first) and `data`
    /// must hold exactly `dtype.bytes_for(product of dims)` bytes.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: DType,
        data: Vec<u8>,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        let n_bytes = self.check_tensor(&name, dims, dtype)?;
        if data.len() != n_bytes {
            return Err(GgufError::TensorSizeMismatch {
                tensor: name,
                expected: n_bytes,
                found: data.len(),
            });
        }
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            dtype,
            n_bytes,
            data: Some(data),
        });
        Ok(self)
    }

    /// Adds a tensor without its data, which the caller of
    /// [`GgufWriter::write_to`] streams (and [`GgufWriter::to_bytes`] writes
    /// as zeros). `dims` are in ggml order, as for [`GgufWriter::add_tensor`].
    pub fn add_tensor_info(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: DType,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        let n_bytes = self.check_tensor(&name, dims, dtype)?;
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            dtype,
            n_bytes,
            data: None,
        });
        Ok(self)
    }

    /// A new tensor's byte count, after checking its name is new and its
    /// shape valid for its type.
    fn check_tensor(&self, name: &str, dims: &[u64], dtype: DType) -> Result<usize, GgufError> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor(name.to_owned()));
        }
        Ok(tensor_size(name, dims, dtype)?.1)
    }

    /// The metadata entries, in the order they are written.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// Each tensor's name, dimensions (ggml order) and type, in file order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = (&str, &[u64], DType)> + '_ {
        self.tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dims.as_slice(), t.dtype))
    }

    /// The alignment the data section is laid out with: `general.alignment`
    /// if it is set to a power of two that fits in `u32`, else 32.
    pub fn alignment(&self) -> u32 {
        self.metadata
            .iter()
            .find(|(key, _)| key == "general.alignment")
            .and_then(|(key, value)| value_to_u32(key, value).ok())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The header: magic, version, counts, metadata and tensor
    /// descriptions, without the padding that aligns the data section.
    fn header(&self) -> Vec<u8> {
        let alignment = self.alignment() as usize;
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        put_len(&mut out, self.tensors.len());
        put_len(&mut out, self.metadata.len());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut out, value);
        }

        let mut offset = 0;
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for dim in &t.dims {
                out.extend_from_slice(&dim.to_le_bytes());
            }
            out.extend_from_slice(&t.dtype.ggml_id().to_le_bytes());
            put_len(&mut out, offset);
            offset = (offset + t.n_bytes).next_multiple_of(alignment);
        }
        out
    }

    /// The file's length in bytes: header, data, and the padding that
    /// aligns each tensor's data.
    pub fn file_len(&self) -> u64 {
        let alignment = self.alignment() as u64;
        let mut len = self.header().len() as u64;
        for t in &self.tensors {
            len = len.next_multiple_of(alignment) + t.n_bytes as u64;
        }
        len
    }

    /// Writes the header and the padding after it, so that the data section
    /// starts where it ends (when the file has tensors), and returns the
    /// bytes written. [`GgufWriter::write_to`] writes the data after it.
    pub fn write_header(&self, out: &mut dyn Write) -> io::Result<u64> {
        let mut header = self.header();
        if !self.tensors.is_empty() {
            header.resize(header.len().next_multiple_of(self.alignment() as usize), 0);
        }
        out.write_all(&header)?;
        Ok(header.len() as u64)
    }

    /// Writes the whole file to `out` and returns its length. The data of a
    /// tensor added with [`GgufWriter::add_tensor_info`] is what
    /// `stream(index, out)` writes when its turn comes (`index` counts every
    /// tensor, in the order they were added); it must be exactly the
    /// tensor's size, or the file is refused with an error.
    pub fn write_to(
        &self,
        out: &mut dyn Write,
        mut stream: impl FnMut(usize, &mut dyn Write) -> io::Result<()>,
    ) -> io::Result<u64> {
        let alignment = self.alignment() as u64;
        let mut at = self.write_header(out)?;
        let padding = [0u8; 256];
        for (index, t) in self.tensors.iter().enumerate() {
            let gap = (at.next_multiple_of(alignment) - at) as usize;
            // An alignment beyond the buffer comes in several writes.
            for _ in 0..gap / padding.len() {
                out.write_all(&padding)?;
            }
            out.write_all(&padding[..gap % padding.len()])?;
            at += gap as u64;
            match &t.data {
                Some(data) => out.write_all(data)?,
                None => {
                    let mut counted = Counted {
                        inner: &mut *out,
                        written: 0,
                    };
                    stream(index, &mut counted)?;
                    if counted.written != t.n_bytes as u64 {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "tensor `{}` needs {} bytes of data, {} were written",
                                t.name, t.n_bytes, counted.written
                            ),
                        ));
                    }
                }
            }
            at += t.n_bytes as u64;
        }
        out.flush()?;
        Ok(at)
    }

    /// The file's bytes; tensors added without data hold zeros.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(usize::try_from(self.file_len()).unwrap_or(0));
        let zeros = |index: usize, out: &mut dyn Write| {
            let n = self.tensors.get(index).map_or(0, |t| t.n_bytes);
            out.write_all(&vec![0; n])
        };
        // Writing to a vector fails only where a streamed tensor's size is
        // wrong, which zeros of its own size never are.
        let _ = self.write_to(&mut out, zeros);
        out
    }
}

/// A writer that counts the bytes passed through it.
struct Counted<'a> {
    inner: &'a mut dyn Write,
    written: u64,
}

impl Write for Counted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(&(len as u64).to_le_bytes());
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    put_len(out, s.len());
    out.extend_from_slice(s.as_bytes());
}

/// Writes a value's payload (its type tag is written by the caller).
fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// Writes an array: element type, count, elements.
fn put_array(out: &mut Vec<u8>, array: &Array) {
    out.extend_from_slice(&array.elem_type().id().to_le_bytes());
    put_len(out, array.len());
    match array {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::U16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::I16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::U32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::I32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_string(out, s)),
        Array::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        Array::U64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::I64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Array::F64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    fn every_scalar() -> Vec<(&'static str, Value)> {
        vec![
            ("t.u8", Value::U8(200)),
            ("t.i8", Value::I8(-100)),
            ("t.u16", Value::U16(60_000)),
            ("t.i16", Value::I16(-30_000)),
            ("t.u32", Value::U32(4_000_000_000)),
            ("t.i32", Value::I32(-2_000_000_000)),
            ("t.f32", Value::F32(-1.5e-7)),
            ("t.bool.true", Value::Bool(true)),
            ("t.bool.false", Value::Bool(false)),
            ("t.string", Value::from("héllo ▁wörld 🦙")),
            ("t.string.empty", Value::from("")),
            ("t.u64", Value::U64(u64::MAX)),
            ("t.i64", Value::I64(i64::MIN)),
            ("t.f64", Value::F64(std::f64::consts::PI)),
        ]
    }

    fn every_array() -> Vec<(&'static str, Array)> {
        vec![
            ("a.u8", Array::U8(vec![0, 1, 255])),
            ("a.i8", Array::I8(vec![-128, 0, 127])),
            ("a.u16", Array::U16(vec![0, 65_535])),
            ("a.i16", Array::I16(vec![-32_768, 32_767])),
            ("a.u32", Array::U32(vec![0, u32::MAX])),
            ("a.i32", Array::I32(vec![i32::MIN, -1, 0, i32::MAX])),
            ("a.f32", Array::F32(vec![0.0, -0.5, f32::INFINITY, 1e30])),
            ("a.bool", Array::Bool(vec![true, false, true])),
            ("a.string", Array::from(vec!["<s>", "", "▁the", "\n"])),
            ("a.u64", Array::U64(vec![u64::MAX, 0])),
            ("a.i64", Array::I64(vec![i64::MIN, i64::MAX])),
            ("a.f64", Array::F64(vec![-0.0, 1e300])),
            ("a.empty", Array::F32(vec![])),
            (
                "a.nested",
                Array::Array(vec![
                    Array::U8(vec![1, 2]),
                    Array::from(vec!["x"]),
                    Array::Array(vec![Array::Bool(vec![true]), Array::I64(vec![])]),
                    Array::Array(vec![]),
                ]),
            ),
        ]
    }

    /// An array nested `depth` deep: depth 1 is an array of scalars.
    fn nested(depth: usize) -> Array {
        let mut a = Array::U32(vec![7]);
        for _ in 1..depth {
            a = Array::Array(vec![a]);
        }
        a
    }

    #[test]
    fn every_value_type_round_trips() {
        let mut w = GgufWriter::new();
        for (key, value) in every_scalar() {
            w.add_metadata(key, value);
        }
        for (key, array) in every_array() {
            w.add_metadata(key, array);
        }
        w.add_metadata("a.deepest", nested(crate::gguf::MAX_ARRAY_DEPTH));
        let file = GgufFile::from_bytes(w.to_bytes()).unwrap();

        assert_eq!(file.version(), 3);
        assert_eq!(file.metadata(), w.metadata());
        for (key, value) in every_scalar() {
            assert_eq!(file.get(key), Some(&value), "{key}");
        }
        for (key, array) in every_array() {
            assert_eq!(file.get(key), Some(&Value::Array(array)), "{key}");
        }
        assert_eq!(file.get_str("t.string").unwrap(), "héllo ▁wörld 🦙");
        assert_eq!(file.get_u32("t.u32").unwrap(), 4_000_000_000);
        assert_eq!(file.get_u64("t.u64").unwrap(), u64::MAX);
        assert_eq!(file.get_f32("t.f32").unwrap(), -1.5e-7);
        assert!(file.get_bool("t.bool.true").unwrap());
        assert_eq!(
            file.get_str_array("a.string").unwrap(),
            ["<s>", "", "▁the", "\n"]
        );
        assert_eq!(
            file.get_i32_array("a.i32").unwrap(),
            [i32::MIN, -1, 0, i32::MAX]
        );
        assert_eq!(
            file.get_f32_array("a.f32").unwrap(),
            [0.0, -0.5, f32::INFINITY, 1e30]
        );
        assert!(file.tensors().is_empty());
    }

    #[test]
    fn getters_widen_and_narrow_numbers() {
        let mut w = GgufWriter::new();
        for (key, value) in every_scalar() {
            w.add_metadata(key, value);
        }
        for (key, array) in every_array() {
            w.add_metadata(key, array);
        }
        let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(file.get_u32("t.u8").unwrap(), 200);
        assert_eq!(file.get_u32("t.u16").unwrap(), 60_000);
        assert_eq!(file.get_u64("t.u32").unwrap(), 4_000_000_000);
        assert_eq!(file.get_f32("t.f64").unwrap(), std::f32::consts::PI);
        assert_eq!(file.get_f32("t.u8").unwrap(), 200.0);
        assert_eq!(file.get_i32_array("a.u16").unwrap(), [0, 65_535]);
        assert_eq!(file.get_f32_array("a.i8").unwrap(), [-128.0, 0.0, 127.0]);
        assert_eq!(
            file.get_f32_array("a.f64").unwrap(),
            [-0.0, 1e300_f64 as f32]
        );
    }

    #[test]
    fn tensors_of_every_dtype_round_trip() {
        let mut w = GgufWriter::new();
        let mut expected = Vec::new();
        for (i, dtype) in DType::ALL.into_iter().enumerate() {
            let dims = [dtype.block_len() as u64 * 3, 5, 2];
            let n = dims.iter().product::<u64>() as usize;
            let data: Vec<u8> = (0..dtype.bytes_for(n).unwrap())
                .map(|b| (b * 31 + i) as u8)
                .collect();
            let name = format!("blk.{i}.{dtype}.weight");
            w.add_tensor(&name, &dims, dtype, data.clone()).unwrap();
            expected.push((name, dims, dtype, n, data));
        }
        // One tensor of each rank, the last ending the file unaligned.
        w.add_tensor("rank1", &[3], DType::F16, vec![1; 6]).unwrap();
        w.add_tensor("rank4", &[1, 1, 1, 1], DType::F32, vec![2; 4])
            .unwrap();

        let bytes = w.to_bytes();
        let file = GgufFile::from_bytes(bytes.clone()).unwrap();
        assert_eq!(file.tensors().len(), DType::ALL.len() + 2);
        assert_eq!(file.data_offset() % 32, 0);
        for (name, dims, dtype, n, data) in &expected {
            let t = file.tensor(name).unwrap();
            assert_eq!(&t.dims, dims);
            assert_eq!(t.dtype, *dtype);
            assert_eq!(t.n_elements, *n as u64);
            assert_eq!(t.n_bytes, data.len());
            assert_eq!(t.offset % 32, 0);
            assert_eq!(file.tensor_data(t), &data[..]);
        }
        assert_eq!(file.tensor_data(file.tensor("rank1").unwrap()), [1; 6]);
        let rank4 = file.tensor("rank4").unwrap();
        assert_eq!(rank4.dims, [1, 1, 1, 1]);
        assert_eq!(file.tensor_data(rank4), [2; 4]);
        assert_eq!(
            file.data_offset() + rank4.offset + 4,
            bytes.len() as u64,
            "the last tensor ends the file"
        );
    }

    #[test]
    fn alignment_comes_from_metadata() {
        let mut w = GgufWriter::new();
        w.add_metadata("general.alignment", 256u32);
        w.add_tensor("a", &[3], DType::F32, vec![1; 12]).unwrap();
        w.add_tensor("b", &[3], DType::F32, vec![2; 12]).unwrap();
        assert_eq!(w.alignment(), 256);
        let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(file.alignment(), 256);
        assert_eq!(file.data_offset() % 256, 0);
        let b = file.tensor("b").unwrap();
        assert_eq!(b.offset, 256);
        assert_eq!(file.tensor_data(b), [2; 12]);
    }

    #[test]
    fn streamed_tensors_are_written_by_the_caller_in_order() {
        let mut w = GgufWriter::new();
        w.add_metadata("general.name", "streamed");
        w.add_tensor("held", &[3], DType::F32, vec![1; 12]).unwrap();
        w.add_tensor_info("a", &[32, 2], DType::Q8_0).unwrap();
        w.add_tensor_info("b", &[5], DType::F16).unwrap();
        let names: Vec<_> = w.tensors().map(|(name, _, _)| name).collect();
        assert_eq!(names, ["held", "a", "b"]);

        let mut out = Vec::new();
        let mut asked = Vec::new();
        let len = w
            .write_to(&mut out, |index, out| {
                asked.push(index);
                let n = [0, 68, 10][index];
                out.write_all(&vec![index as u8 + 10; n])
            })
            .unwrap();
        assert_eq!(asked, [1, 2], "only tensors without data are asked for");
        assert_eq!((len, out.len() as u64), (w.file_len(), w.file_len()));
        let file = GgufFile::from_bytes(out).unwrap();
        assert_eq!(file.tensor_data(file.tensor("held").unwrap()), [1; 12]);
        assert_eq!(file.tensor_data(file.tensor("a").unwrap()), [11; 68]);
        assert_eq!(file.tensor_data(file.tensor("b").unwrap()), [12; 10]);
        assert_eq!(file.tensor("b").unwrap().offset % 32, 0);

        // The header alone ends where the data section starts.
        let mut header = Vec::new();
        let header_len = w.write_header(&mut header).unwrap();
        assert_eq!(header_len, file.data_offset());
        assert_eq!(header.len() as u64, header_len);

        // to_bytes writes zeros for them.
        let zeros = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(zeros.tensor_data(zeros.tensor("a").unwrap()), [0; 68]);
    }

    #[test]
    fn a_streamed_tensor_of_the_wrong_size_is_an_error() {
        let mut w = GgufWriter::new();
        w.add_tensor_info("a", &[32], DType::Q8_0).unwrap();
        let err = w
            .write_to(&mut Vec::new(), |_, out| out.write_all(&[0; 33]))
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("`a` needs 34 bytes"), "{err}");
        assert!(matches!(
            w.add_tensor_info("a", &[32], DType::Q8_0),
            Err(GgufError::DuplicateTensor(_))
        ));
    }

    #[test]
    fn add_metadata_replaces_in_place() {
        let mut w = GgufWriter::new();
        w.add_metadata("a", 1u32)
            .add_metadata("b", 2u32)
            .add_metadata("a", "x");
        let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(
            file.metadata(),
            [
                ("a".to_owned(), Value::from("x")),
                ("b".to_owned(), Value::U32(2))
            ]
        );
    }

    #[test]
    fn add_tensor_rejects_invalid_tensors() {
        let mut w = GgufWriter::new();
        w.add_tensor("t", &[32], DType::Q8_0, vec![0; 34]).unwrap();
        assert!(matches!(
            w.add_tensor("t", &[32], DType::Q8_0, vec![0; 34]),
            Err(GgufError::DuplicateTensor(name)) if name == "t"
        ));
        assert!(matches!(
            w.add_tensor("u", &[32], DType::Q8_0, vec![0; 33]),
            Err(GgufError::TensorSizeMismatch {
                expected: 34,
                found: 33,
                ..
            })
        ));
        for dims in [
            &[][..],
            &[16],
            &[32, 0],
            &[32, 1, 1, 1, 1],
            &[u64::MAX / 2, 64],
        ] {
            assert!(
                matches!(
                    w.add_tensor("u", dims, DType::Q8_0, vec![]),
                    Err(GgufError::BadDimensions { ref tensor, .. }) if tensor == "u"
                ),
                "{dims:?}"
            );
        }
    }
}
