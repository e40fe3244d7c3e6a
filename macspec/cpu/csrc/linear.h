// The float32 few-row products (cpu_linear.cpp) as a function, for the fused decoder block
// (cpu_block.cpp): several products share one job of the thread pool. The quantized ones are in
// quant.h.
#pragma once

namespace macspec {

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

}  // namespace macspec
