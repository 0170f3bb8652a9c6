// `fused_matmul`: up to three matrix products that share their input, with
// an optional RMSNorm of the input before them and one of three epilogues.
//
// Arguments: `x: f32[rows, k]` (read), `g: f32[k]` (read; empty without
// norm), `w0, w1, w2` (read, GGUF blocks; empty when unused), `y0, y1, y2:
// f32[rows, n_i]` (write, read-write for accumulate; empty when unused),
// `b0, b1, b2: f32[n_i]` (read; empty where `s.bias` has no bit),
// `FusedShape s` (value: rows, k, each weight's columns and ggml type, the
// weights in use, the epilogue, whether to norm, eps, the biased outputs).
//
// With `xn = norm ? rms_norm(x) * g : x` and `p_i[r, j] = Σ_c w_i[j, c] xn[r, c]`:
// EPILOGUE_STORE `y_i = p_i` for each weight (Q, K and V), plus `b_i` where
// bit `i` of `s.bias` is set; EPILOGUE_ACCUMULATE
// `y_0 += p_0` (a projection into the residual); EPILOGUE_SWIGLU
// `y_0 = silu(p_0) * p_1` (gate and up).
//
// The default version folds the norm into the product: each warp sums the
// squares of the activations it reads anyway and scales its finished dot
// product by `1 / rms` (quant_dots_fast.cuh). For one activation row and
// weights in blocks of 32 (MM_Q8), the block quantizes the input times the
// norm weights to 8 bits once and sums the squares while it does.
// MM_THREADS, MM_COLS, MM_SPLIT and MM_Q8 (cuda/geometry.rs) and the
// EPILOGUE_* values (kernels/fused.rs) come from Rust, prepended to this
// source.

#include "gguf.cuh"
#include "matmul_dots.cuh"
#include "quant_dots_fast.cuh"
#include "fused_matmul.cuh"
