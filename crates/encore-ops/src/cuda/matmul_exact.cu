// `matmul`, exact version (`encore_ops::KernelSet::Exact`): the CPU's results bit
// for bit.
//
// Arguments: `w: dtype[n, k]` (read, raw GGUF blocks), `x: f32[rows, k]`
// (read), `y: f32[rows, n]` (write), `MatmulShape s` (value: rows, n, k and
// the ggml type id of the weights; matmul_shape.cuh).
//
// `y[r, j] = Σ_i w[j, i] x[r, i]` for the `rows` activation rows.
//
// Quantized weights multiply activations quantized to 8-bit blocks as the
// CPU quantizes them, summed in the CPU's order (quant_dots_exact.cuh); the
// kernel is matmul.cu's. MM_THREADS and MM_COLS come from Rust, prepended to
// this source (cuda/geometry.rs).

#include "gguf.cuh"
#include "matmul_dots.cuh"
#include "quant_dots_exact.cuh"
#include "matmul.cuh"
