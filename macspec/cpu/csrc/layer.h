// What the layer primitives (cpu_layer.cpp, cpu_attention.cpp) share: 8-lane float vectors,
// the sums and the exponential they are computed with, and the primitives' base class.
#pragma once

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <immintrin.h>

#include "common.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace macspec {

typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  return *(const f8u*)p;
}

inline void store8(float* p, f8 v) {
  *(f8u*)p = v;
}

// The lanes of v summed, pairwise (lane i + lane i + 4, then + 2, + 1).
inline float hsum8(f8 v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

inline float dot(const float* a, const float* b, int n) {
  f8 acc{};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    acc += load8(a + i) * load8(b + i);
  }
  float s = hsum8(acc);
  for (; i < n; i++) {
    s += a[i] * b[i];
  }
  return s;
}

// t rounded to the nearest integer (ties to even), as the exponential below needs it.
inline f8 round_even(f8 t) {
  return (f8)_mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

#if defined(__AVX512F__)
// 16 floats, one AVX-512 register: two 8-lane vectors side by side (cpu_attention.cpp).
typedef float f8x2 __attribute__((vector_size(64)));
typedef float f8x2u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i8x2 __attribute__((vector_size(64)));

inline f8x2 round_even(f8x2 t) {
  return (f8x2)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

// exp(x) as MLX computes it on the CPU (2^n * 2^f, Cephes' polynomial for 2^f), lane by lane:
// V float lanes, I int32 lanes as many. Every width computes a lane with the same operations,
// so 8 lanes and 16 give the same bits.
template <typename V, typename I>
inline V exp_lanes(V x) {
  const V lo = V{} - 127.0f, hi = V{} + 127.0f;
  V t = x * 1.4426950408889634f;
  t = t < lo ? lo : (t > hi ? hi : t);
  V n = round_even(t);
  V f = t - n;
  V p = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return t > lo ? p * scale : V{};
}

inline f8 exp8(f8 x) {
  return exp_lanes<f8, i8>(x);
}

#if defined(__AVX512F__)
inline f8x2 exp8x2(f8x2 x) {
  return exp_lanes<f8x2, i8x2>(x);
}
#endif

inline void check_float32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("[macspec] float32 ") + what);
  }
}

// Registers the primitive's arrays with MLX's CPU stream and allocates its outputs.
inline mx::cpu::CommandEncoder& start(
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  return encoder;
}

// The layer kernels, for their primitives and the fused block (cpu_block.cpp, cpu_attn_mlp.cpp);
// rows are row-contiguous. cpu_layer.cpp:
void norm_rows(const float* x, const float* w, float* y, int rows, int D, float eps);
void swiglu_n(const float* g, const float* u, float* y, size_t n);
void rope_rows(const float* q, const float* k, const float* v, const float* cos, const float* sin,
               int half, const int32_t* positions, int offset, int L, int H, int KVH, int D,
               bool traditional, float* qo, float* ko, float* vo);
// cpu_attention.cpp: q (1, H, L, D); k, v (1, KVH, T, D), read in place where rows lie in order.
void attend_rows(const mx::array& q, const mx::array& k, const mx::array& v, const bool* mask,
                 float scale, bool causal, float* y);
// The same for the query rows q0..q0+L of qp (H, Lq, D) (one row's ids of a shared pass's block)
// over the first T keys and values of k, v (a cache's whole buffer; float32 or float16).
void attend_query_rows(const float* qp, int H, int Lq, int q0, int L, int D, const mx::array& k,
                       const mx::array& v, int T, const bool* mask, float scale, bool causal,
                       float* y);

class LayerOp : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[macspec layer ops] CPU only");
  }
};

}  // namespace macspec
