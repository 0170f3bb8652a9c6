// The value argument of `matmul` and `gemm`: `y[rows, n] = x[rows, k] · wᵀ`
// with weights of ggml type `dtype` (kernels/matmul.rs, `MatmulShape`).

struct MatmulShape {
    unsigned int rows;
    unsigned int n;
    unsigned int k;
    unsigned int dtype;
};
