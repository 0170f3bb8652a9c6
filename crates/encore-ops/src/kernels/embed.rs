//! Embedding lookup: `y[r, :] = dequantize(table[tokens[r], :])`.
//!
//! Arguments: `table: dtype[vocab, dim]` (read), `tokens: u32[rows]` (read),
//! `y: f32[rows, dim]` (write), [`EmbedShape`] (value).

use encore::KernelDef;

use crate::cpu::dequantize_row;
use crate::DType;

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct EmbedShape {
    pub rows: u32,
    pub dim: u32,
    pub vocab: u32,
    /// ggml type id of the table.
    pub dtype: u32,
}

pub fn def() -> KernelDef {
    KernelDef::new("embed").op("embed").cpu("embed v1", |a| {
        let s: EmbedShape = a.scalar(3)?;
        let dtype = DType::from_ggml_id(s.dtype).ok_or("unsupported table type")?;
        let dim = s.dim as usize;
        let row_bytes = dtype
            .bytes_for(dim)
            .ok_or("row length not a whole number of blocks")?;
        let (table, tokens, y) = (a.read::<u8>(0)?, a.read::<u32>(1)?, a.write::<f32>(2)?);
        super::need("tokens", tokens, s.rows as usize)?;
        super::need("y", y, s.rows as usize * dim)?;
        for (r, out) in y.chunks_exact_mut(dim).take(s.rows as usize).enumerate() {
            let t = tokens[r];
            if t >= s.vocab {
                return Err(format!(
                    "token id {t} out of range (vocabulary {})",
                    s.vocab
                ));
            }
            let start = t as usize * row_bytes;
            let row = table
                .get(start..start + row_bytes)
                .ok_or("embedding table too short")?;
            dequantize_row(dtype, row, out).map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}
