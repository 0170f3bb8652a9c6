//! The CPU body of `embed` ([`crate::kernels::embed`]).

use encore::CpuArgs;

use crate::cpu::dequantize_row;
use crate::kernels::embed::EmbedArgs;
use crate::DType;

pub(crate) fn embed(a: &CpuArgs<'_>) -> Result<(), String> {
    let args = EmbedArgs::from_cpu(a)?;
    let s = args.shape;
    let dtype = DType::from_ggml_id(s.dtype).ok_or("unsupported table type")?;
    let dim = s.dim as usize;
    let row_bytes = dtype
        .bytes_for(dim)
        .ok_or("row length not a whole number of blocks")?;
    let (table, tokens, y) = (
        args.table.read::<u8>()?,
        args.tokens.read::<u32>()?,
        args.y.write::<f32>()?,
    );
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
}
