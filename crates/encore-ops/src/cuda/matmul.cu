// `matmul`: matrix products with (possibly quantized) weights.
//
// Arguments: `w: dtype[n, k]` (read, raw GGUF blocks), `x: f32[rows, k]`
// (read), `y: f32[rows, n]` (write), `MatmulShape s` (value: rows, n, k and
// the ggml type id of the weights; matmul_shape.cuh).
//
// `y[r, j] = Σ_i w[j, i] x[r, i]` for the `rows` activation rows.
//
// The default version: quantized weights are dequantized and multiplied
// with f32 activations (quant_dots_fast.cuh), within the activation
// quantization error of the CPU's results; an output head of weights in
// blocks of 32 takes 8-bit activations (MM_Q8). matmul_exact.cu is the same
// kernel with the CPU's bits. MM_THREADS, MM_COLS, MM_WIDE_N and MM_Q8 come
// from Rust, prepended to this source (cuda/geometry.rs).

#include "gguf.cuh"
#include "matmul_dots.cuh"
#include "quant_dots_fast.cuh"
#include "matmul.cuh"
