// Quantized products with float activations: the weights unpacked to float32, float FMAs. The
// int8 products (cpu_qint8.cpp) replace them where the CPU has integer dot products; these stay
// for MACSPEC_INT8_ACTIVATIONS=0 and for CPUs without them.
//
// Each output y[m, n] is computed in the same order whatever the number of rows and threads.

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "quant.h"
#include "vec16.h"

namespace macspec {

// Rows [n0, n1) for MB rows of x. `xq` holds x reordered to match the unpacking (even columns,
// then odd ones, per 32 columns for 4 bits) and `xs` the sum of x over each group, for the bias
// term. 4 bits: element 2j in the low and 2j + 1 in the high nibble of byte j.
template <int BITS, int G, int MB, int R, ScaleType T>
static void q_block(
    const uint8_t* Wq,
    const void* scales,
    const void* biases,
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
        float s = scale_of<T>(scales, (size_t)(n + r) * groups + g);
        for (int m = 0; m < MB; m++) {
          acc[m][r] += gacc[m][r] * s;
        }
      }
    }
    float sums[MB * R];
    hsums<MB * R>(&acc[0][0], sums);
    for (int m = 0; m < MB; m++) {
      for (int r = 0; r < R; r++) {
        float b = 0.0f;
        for (int g = 0; g < groups; g++) {
          b += scale_of<T>(biases, (size_t)(n + r) * groups + g) * xs[(size_t)m * groups + g];
        }
        y[(size_t)m * N + n + r] = sums[m * R + r] + b;
      }
    }
  }
  if (n < n1) {
    q_block<BITS, G, MB, 1, T>(Wq, scales, biases, xq, xs, y, n, n1, N, K);
  }
}

// Weight rows per quantized block: with 32 registers the blocks measured fastest on AVX-512;
// else two accumulators per (x row, weight row) and two weight vectors per weight row must fit.
template <int MB>
constexpr int QR = VREGS >= 32 ? (MB <= 2 ? 4 : 2) : rows_fitting(MB, 2, 2);

template <int BITS, int G, ScaleType T>
static void q_dispatch(const QProduct& p, const float* xq, const float* xs, int n0, int n1) {
  const int groups = p.K / G;
  // Up to 4 rows of x per unpacked weight vector. With 16 AVX2 registers some accumulators
  // spill, but unpacking each weight half as often measured 7-16% faster than 2 rows.
  constexpr int MBMAX = 4;
  for (int m0 = 0; m0 < p.M; m0 += MBMAX) {
    const float* xm = xq + (size_t)m0 * p.K;
    const float* sm = xs + (size_t)m0 * groups;
    float* ym = p.y + (size_t)m0 * p.N;
#define MACSPEC_QB(MB) \
  q_block<BITS, G, MB, QR<MB>, T>(p.W, p.scales, p.biases, xm, sm, ym, n0, n1, p.N, p.K)
    switch (std::min(p.M - m0, MBMAX)) {
      case 1: MACSPEC_QB(1); break;
      case 2: MACSPEC_QB(2); break;
      case 3: MACSPEC_QB(3); break;
      default: MACSPEC_QB(4); break;
    }
#undef MACSPEC_QB
  }
}

template <ScaleType T>
static void q_chunk(const QProduct& p, const float* xq, const float* xs, int n0, int n1) {
#define MACSPEC_Q(B, GS) q_dispatch<B, GS, T>(p, xq, xs, n0, n1)
  if (p.bits == 4 && p.group == 32) MACSPEC_Q(4, 32);
  else if (p.bits == 4 && p.group == 64) MACSPEC_Q(4, 64);
  else if (p.bits == 4 && p.group == 128) MACSPEC_Q(4, 128);
  else if (p.bits == 8 && p.group == 32) MACSPEC_Q(8, 32);
  else if (p.bits == 8 && p.group == 64) MACSPEC_Q(8, 64);
  else MACSPEC_Q(8, 128);
#undef MACSPEC_Q
}

// x reordered as the unpacking reads it, and its sum over each group.
static void prepare_x(const QProduct& p, std::vector<float>& xq, std::vector<float>& xs) {
  const int M = p.M, K = p.K, G = p.group, groups = K / G;
  xq.resize((size_t)M * K);
  xs.resize((size_t)M * groups);
  for (int m = 0; m < M; m++) {
    const float* src = p.x + (size_t)m * K;
    float* dst = xq.data() + (size_t)m * K;
    if (p.bits == 4) {
      for (int c = 0; c < K; c += 32) {
        for (int j = 0; j < 16; j++) {
          dst[c + j] = src[c + 2 * j];
          dst[c + 16 + j] = src[c + 2 * j + 1];
        }
      }
    } else {
      std::copy(src, src + K, dst);
    }
    for (int g = 0; g < groups; g++) {
      float s = 0.0f;
      for (int k = 0; k < G; k++) {
        s += src[g * G + k];
      }
      xs[(size_t)m * groups + g] = s;
    }
  }
}

void q_float_products(const QProduct* ps, int count) {
  for (int j = 0; j < count; j++) {
    if (ps[j].packed || ps[j].type == ScaleType::i8) {  // (factored tables: repacked only)
      throw std::invalid_argument("[macspec products] repacked weights take int8 products only");
    }
  }
  if (count < 1 || count > MAX_JOINED) {
    throw std::invalid_argument("[macspec products] 1 to 4 quantized products in one job");
  }
  std::vector<float> xqs[MAX_JOINED], xss[MAX_JOINED];
  int from[MAX_JOINED], N[MAX_JOINED], row_bytes[MAX_JOINED];
  for (int j = 0; j < count; j++) {
    from[j] = j > 0 && same_x(ps[j - 1], ps[j]) ? from[j - 1] : j;
    if (from[j] == j) {
      prepare_x(ps[j], xqs[j], xss[j]);
    }
    N[j] = ps[j].N;
    row_bytes[j] = ps[j].K * ps[j].bits / 8;
  }
  run_joined(N, row_bytes, count, [&](int j, int n0, int n1) {
    const float *xq = xqs[from[j]].data(), *xs = xss[from[j]].data();
    switch (ps[j].type) {
      case ScaleType::f32: q_chunk<ScaleType::f32>(ps[j], xq, xs, n0, n1); break;
      case ScaleType::f16: q_chunk<ScaleType::f16>(ps[j], xq, xs, n0, n1); break;
      default: q_chunk<ScaleType::bf16>(ps[j], xq, xs, n0, n1); break;
    }
  });
}

}  // namespace macspec
