// The float32 few-row products (cpu_linear.cpp) as a function, for the fused decoder block
// (cpu_block.cpp, cpu_attn_mlp.cpp): several products share one job of the thread pool. The
// quantized ones are in quant.h.
#pragma once

#include <stdexcept>

#include "mlx/array.h"
#include "quant.h"

namespace macspec {

// The scales' (and biases') element type of an MLX affine-quantized matrix.
inline ScaleType scale_type(mlx::core::Dtype dtype) {
  if (dtype == mlx::core::float32) {
    return ScaleType::f32;
  }
  if (dtype == mlx::core::float16) {
    return ScaleType::f16;
  }
  if (dtype == mlx::core::bfloat16) {
    return ScaleType::bf16;
  }
  if (dtype == mlx::core::int8) {  // factored, repacked weights only (packed_shapes)
    return ScaleType::i8;
  }
  throw std::invalid_argument("[macspec] scales of float32, float16 or bfloat16");
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

}  // namespace macspec
