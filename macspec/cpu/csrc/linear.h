// The few-row products as functions: float32 (cpu_linear.cpp), for the fused decoder block
// (cpu_block.cpp), where several share one job of the thread pool; and the quantized ones
// (cpu_qlinear.cpp) for the `qlinear` primitive.
#pragma once

#include <algorithm>
#include <cstdint>

namespace macspec {

// Rows per chunk: ~64 KB of weights (a few microseconds), a multiple of 16 rows, and at
// least four chunks for the threads to share when the matrix allows.
inline int chunk_rows(int N, int row_bytes) {
  int rows = std::max(16, (65536 / std::max(row_bytes, 1)) / 16 * 16);
  while (rows > 16 && (N + rows - 1) / rows < 4) {
    rows -= 16;
  }
  while ((N + rows - 1) / rows > 65535) {  // the pool counts chunks in 16 bits
    rows *= 2;
  }
  return rows;
}

// y (M, N) = x (M, K) @ W (N, K).T, row-contiguous, summed as the `linear` primitive sums.
struct Product {
  const float* W;
  const float* x;
  float* y;
  int M, N, K;
};

// Runs the products together: their chunks are claimed from one job, so the threads wait for
// each other once instead of once per product.
void f32_products(const Product* products, int count);

// y (M, N) = x (M, K) @ W.T for MLX's affine `bits`-bit W (N, K) in groups of G columns: `Wq`
// packed, `sc` and `bi` the groups' scales and biases (float, float16 or bfloat16).
template <typename S>
void q_products(
    const uint8_t* Wq,
    const S* sc,
    const S* bi,
    const float* xr,
    float* y,
    int M,
    int N,
    int K,
    int bits,
    int G);

}  // namespace macspec
