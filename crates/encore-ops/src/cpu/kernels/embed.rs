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

#[cfg(test)]
mod tests {
    use encore::{Config, Device};
    use rand::{rngs::StdRng, SeedableRng};

    use crate::cpu::testing::random_weights;
    use crate::{DType, KernelSet, Ops, Weight};

    /// `embed` on the CPU device gives each token's dequantized row, for
    /// every table type.
    #[test]
    fn embed_gives_dequantized_rows_of_every_type() {
        let device = Device::open("cpu", &Config::default()).unwrap();
        let ops = Ops::new(&device, KernelSet::Default).unwrap();
        let mut rng = StdRng::seed_from_u64(50);
        let (vocab, dim) = (7usize, 512usize);
        let tokens = [3u32, 0, 6, 3];
        for dtype in DType::ALL {
            let table = random_weights(&mut rng, dtype, vocab, dim);
            let w = Weight {
                buffer: device.buffer_from(&table).unwrap(),
                dtype,
                n: vocab,
                k: dim,
            };
            let t = device.buffer_from(&tokens).unwrap();
            let y = device.alloc(tokens.len() * dim * 4).unwrap();
            let mut enc = device.encoder();
            ops.embed(&mut enc, &w, &t, &y, tokens.len()).unwrap();
            enc.commit_and_wait().unwrap();
            let got = y.download::<f32>().unwrap();
            let row_bytes = dtype.bytes_for(dim).unwrap();
            for (r, &tok) in tokens.iter().enumerate() {
                let mut expected = vec![0.0; dim];
                let at = tok as usize * row_bytes;
                crate::cpu::dequantize_row(dtype, &table[at..at + row_bytes], &mut expected)
                    .unwrap();
                assert_eq!(
                    &got[r * dim..(r + 1) * dim],
                    &expected[..],
                    "{dtype} row {r}"
                );
            }
        }
    }
}
