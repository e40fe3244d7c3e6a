// What the fused decoder layer's two primitives share (cpu_block.cpp: norm, q/k/v, RoPE;
// cpu_attn_mlp.cpp: attention, the output product, the MLP): how their weight matrices are
// stored, the checks of them, and their products run together.
#pragma once

#include <vector>

#include "common.h"
#include "mlx/array.h"

namespace macspec {

// How a block's weight matrices are stored: float32 (one array each; bits 32) or MLX's affine
// layout (packed weights, scales, biases) in groups of `group`, and whether the quantized products
// take int8 x. Quantized matrices may differ in bits (a GGUF's Q4_K_M mixes 4 and 8): each one's
// are read off its shapes (bits_of), `bits` only tells float32 from quantized.
struct Mats {
  int bits = 32, group = 0;
  bool int8 = false;

  int arrays() const {
    return bits == 32 ? 1 : 3;
  }
  bool operator==(const Mats&) const = default;
};

// One product of a primitive: y (M, N) = x (M, K) @ matrix.T.
struct Job {
  int matrix;  // which of the primitive's matrices, in input order
  const float* x;
  float* y;
};

// The jobs' products as one job of the pool, each as SmallLinear computes it alone; the
// matrices' arrays start at inputs[first].
void run_products(const Mats& w, const std::vector<mx::array>& in, int first, const Job* jobs,
                  int count, int M);

// K of the matrix whose arrays start at in[i]: a quantized one's from its scales' groups.
inline int cols(const std::vector<mx::array>& in, size_t i, const Mats& m) {
  if (m.bits == 32) {
    return matrix_cols(in[i], 32);
  }
  // groups: repacked weights' (N / 16, groups, ...), else the scales' (N, groups) (repacked
  // scales factored have more rows: cpu_q4packed.cpp)
  return (in[i].ndim() == 3 ? in[i].shape(1) : in[i + 1].shape(1)) * m.group;
}

// Bits of the matrix whose arrays start at in[i] (0 where its shapes hold no whole number).
inline int bits_of(const std::vector<mx::array>& in, size_t i, const Mats& m) {
  if (m.bits == 32) {
    return 32;
  }
  const long K = cols(in, i, m);
  const long bits = in[i].ndim() == 3 ? 2L * in[i].shape(1) * in[i].shape(2) : 32L * in[i].shape(1);
  return K > 0 && bits % K == 0 ? (int)(bits / K) : 0;
}

// Refuses inputs[from, to) unless they are row-contiguous, as the products read them.
void check_weights(const std::vector<mx::array>& inputs, size_t from, size_t to);

// The layout of bits (32, or 4 or 8) and group_size, int8 where this build has int8 products.
Mats layout(int bits, int group_size, bool int8);

// A matrix of N (any where N < 0) rows and K columns, as `w` stores it; returns its rows.
int check_matrix(const std::vector<mx::array>& m, const Mats& w, int N, int K, const char* what);

inline void append(std::vector<mx::array>& inputs, const std::vector<mx::array>& m) {
  inputs.insert(inputs.end(), m.begin(), m.end());
}

}  // namespace macspec
