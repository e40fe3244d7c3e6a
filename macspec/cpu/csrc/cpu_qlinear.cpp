// The quantized few-row products (the `qlinear` primitive of cpu_linear.cpp): MLX's affine 4- and
// 8-bit weights, read once for every row, unpacked in registers. Each output is summed in the
// same order whatever the number of rows and threads, as the float32 products are.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "mlx/array.h"
#include "common.h"
#include "linear.h"
#include "vec16.h"

namespace mx = mlx::core;

namespace macspec {

template <typename S>
static inline float to_float(S v) {
  if constexpr (std::is_same_v<S, mx::bfloat16_t>) {  // the top half of a float32
    uint16_t bits;
    std::memcpy(&bits, &v, 2);
    uint32_t wide = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &wide, 4);
    return f;
  }
#if defined(__F16C__)
  if constexpr (std::is_same_v<S, mx::float16_t>) {  // one instruction, not mlx's emulation
    uint16_t bits;
    std::memcpy(&bits, &v, 2);
    return _cvtsh_ss(bits);
  }
#endif
  return static_cast<float>(v);
}

// Quantized rows: MLX's affine format, w = scale * q + bias per group of `G` columns, q packed
// little-endian in uint32 words (4 bits: element 2j in the low and 2j + 1 in the high nibble
// of byte j). `xq` holds x reordered to match the unpacking (even columns, then odd ones, per
// 32 columns for 4 bits) and `xs` the sum of x over each group, for the bias term.
template <int BITS, int G, int MB, int R, typename S>
static void q_block(
    const uint8_t* Wq,
    const S* scales,
    const S* biases,
    const float* xq,
    const float* xs,
    float* y,
    int n0,
    int n1,
    int N,
    int K) {
  const int groups = K / G;
  const size_t row_bytes = (size_t)K * BITS / 8;
  constexpr int GB = G * BITS / 8;  // bytes of one group of one row
  int n = n0;
  for (; n + R <= n1; n += R) {
    const uint8_t* w = Wq + (size_t)n * row_bytes;
    vf acc[MB][R];
    for (int m = 0; m < MB; m++) {
      for (int r = 0; r < R; r++) {
        acc[m][r] = vf{};
      }
    }
    for (int g = 0; g < groups; g++) {
      vf gacc[MB][R];
      for (int m = 0; m < MB; m++) {
        for (int r = 0; r < R; r++) {
          gacc[m][r] = vf{};
        }
      }
      const float* xg = xq + (size_t)g * G;
      for (int c = 0; c < GB / 16; c++) {
        const size_t at = (size_t)g * GB + c * 16;
        vf lo[R], hi[R];
        for (int r = 0; r < R; r++) {
          __builtin_prefetch(w + (size_t)(R + r) * row_bytes + at);
          vi wide = widen16(w + r * row_bytes + at);
          if constexpr (BITS == 4) {
            lo[r] = to_vf(wide & 15);
            hi[r] = to_vf(wide >> 4);
            pin(hi[r]);
          } else {
            lo[r] = to_vf(wide);
          }
          pin(lo[r]);
        }
        for (int m = 0; m < MB; m++) {
          const float* xm = xg + (size_t)m * K + c * (BITS == 4 ? 32 : 16);
          vf x0 = loadf(xm);
          pin(x0);
          for (int r = 0; r < R; r++) {
            gacc[m][r] += lo[r] * x0;
          }
          if constexpr (BITS == 4) {
            vf x1 = loadf(xm + L);
            pin(x1);
            for (int r = 0; r < R; r++) {
              gacc[m][r] += hi[r] * x1;
            }
          }
        }
      }
      for (int r = 0; r < R; r++) {
        float s = to_float(scales[(size_t)(n + r) * groups + g]);
        for (int m = 0; m < MB; m++) {
          acc[m][r] += gacc[m][r] * s;
        }
      }
    }
    float sums[MB * R];
    hsums<MB * R>(&acc[0][0], sums);
    for (int m = 0; m < MB; m++) {
      for (int r = 0; r < R; r++) {
        const S* bi = biases + (size_t)(n + r) * groups;
        float b = 0.0f;
        for (int g = 0; g < groups; g++) {
          b += to_float(bi[g]) * xs[(size_t)m * groups + g];
        }
        y[(size_t)m * N + n + r] = sums[m * R + r] + b;
      }
    }
  }
  if (n < n1) {
    q_block<BITS, G, MB, 1, S>(Wq, scales, biases, xq, xs, y, n, n1, N, K);
  }
}

// Weight rows per quantized block: with 32 registers the blocks measured fastest on AVX-512;
// else two accumulators per (x row, weight row) and two weight vectors per weight row must fit.
template <int MB>
constexpr int QR = VREGS >= 32 ? (MB <= 2 ? 4 : 2) : rows_fitting(MB, 2, 2);

template <int BITS, int G, typename S>
static void q_dispatch(
    const uint8_t* Wq,
    const S* scales,
    const S* biases,
    const float* xq,
    const float* xs,
    float* y,
    int M,
    int n0,
    int n1,
    int N,
    int K) {
  const int groups = K / G;
  // Up to 4 rows of x per unpacked weight vector. With 16 AVX2 registers some accumulators
  // spill, but unpacking each weight half as often measured 7-16% faster than 2 rows.
  constexpr int MBMAX = 4;
  for (int m0 = 0; m0 < M; m0 += MBMAX) {
    const float* xm = xq + (size_t)m0 * K;
    const float* sm = xs + (size_t)m0 * groups;
    float* ym = y + (size_t)m0 * N;
    switch (std::min(M - m0, MBMAX)) {
      case 1: q_block<BITS, G, 1, QR<1>, S>(Wq, scales, biases, xm, sm, ym, n0, n1, N, K); break;
      case 2: q_block<BITS, G, 2, QR<2>, S>(Wq, scales, biases, xm, sm, ym, n0, n1, N, K); break;
      case 3: q_block<BITS, G, 3, QR<3>, S>(Wq, scales, biases, xm, sm, ym, n0, n1, N, K); break;
      default: q_block<BITS, G, 4, QR<4>, S>(Wq, scales, biases, xm, sm, ym, n0, n1, N, K); break;
    }
  }
}

// The quantized product of M rows: x reordered as the unpacking reads it and summed over each
// group, then the weight rows shared out to the pool in chunks.
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
    int G) {
  const int groups = K / G;
  std::vector<float> xq((size_t)M * K), xs((size_t)M * groups);
  for (int m = 0; m < M; m++) {
    const float* src = xr + (size_t)m * K;
    float* dst = xq.data() + (size_t)m * K;
    if (bits == 4) {
      for (int c = 0; c < K; c += 32) {
        for (int j = 0; j < 16; j++) {
          dst[c + j] = src[c + 2 * j];
          dst[c + 16 + j] = src[c + 2 * j + 1];
        }
      }
    } else {
      std::memcpy(dst, src, sizeof(float) * K);
    }
    for (int g = 0; g < groups; g++) {
      float s = 0.0f;
      for (int k = 0; k < G; k++) {
        s += src[g * G + k];
      }
      xs[(size_t)m * groups + g] = s;
    }
  }
  const int rows = chunk_rows(N, K * bits / 8);
  Pool::get().run((N + rows - 1) / rows, [&](int c) {
    int n0 = c * rows, n1 = std::min(N, (c + 1) * rows);
    auto* q = xq.data();
    auto* s = xs.data();
#define MACSPEC_Q(B, GS) q_dispatch<B, GS, S>(Wq, sc, bi, q, s, y, M, n0, n1, N, K)
    if (bits == 4 && G == 32) MACSPEC_Q(4, 32);
    else if (bits == 4 && G == 64) MACSPEC_Q(4, 64);
    else if (bits == 4 && G == 128) MACSPEC_Q(4, 128);
    else if (bits == 8 && G == 32) MACSPEC_Q(8, 32);
    else if (bits == 8 && G == 64) MACSPEC_Q(8, 64);
    else MACSPEC_Q(8, 128);
#undef MACSPEC_Q
  });
}

// The scale types MLX's quantized layers hold.
#define MACSPEC_Q_PRODUCTS(S) \
  template void q_products<S>(                                                           \
      const uint8_t*, const S*, const S*, const float*, float*, int, int, int, int, int);
MACSPEC_Q_PRODUCTS(float)
MACSPEC_Q_PRODUCTS(mx::float16_t)
MACSPEC_Q_PRODUCTS(mx::bfloat16_t)
#undef MACSPEC_Q_PRODUCTS

}  // namespace macspec
