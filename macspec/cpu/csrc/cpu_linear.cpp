// Matrix products for a few rows on MLX's CPU backend: y = x @ W.T for float32 W, and for MLX's
// affine 4- and 8-bit quantized W. One pass over the weights serves every row (verifying K
// drafts reads them once), split over the cores. Built on the user's machine by
// macspec/cpu/native.py with -march=native; macspec falls back to mlx's own ops without it.
//
// Each output y[m, n] is computed in the same order whatever the number of rows and threads, so a
// plain step and a verification row give bit-identical results for identical inputs.

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "common.h"
#include "linear.h"
#include "vec16.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace macspec {

// ---------------------------------------------------------------- kernels

// Rows [n0, n1) of y = x @ W.T for MB rows of x (K % L tail done in scalar).
template <int MB, int R>
static void f32_block(
    const float* W,
    const float* x,
    float* y,
    int n0,
    int n1,
    int N,
    int K) {
  const int KV = K - K % L;
  int n = n0;
  for (; n + R <= n1; n += R) {
    vf acc[MB][R];
    for (int m = 0; m < MB; m++) {
      for (int r = 0; r < R; r++) {
        acc[m][r] = vf{};
      }
    }
    const float* w = W + (size_t)n * K;
    for (int k = 0; k < KV; k += L) {
      vf wv[R];
      for (int r = 0; r < R; r++) {
        // The next block's rows, one line per line read: the loads then rarely wait on memory.
        __builtin_prefetch(w + (size_t)(R + r) * K + k);
        wv[r] = loadf(w + (size_t)r * K + k);
        pin(wv[r]);
      }
      for (int m = 0; m < MB; m++) {
        vf xv = loadf(x + (size_t)m * K + k);
        pin(xv);
        for (int r = 0; r < R; r++) {
          acc[m][r] += wv[r] * xv;
        }
      }
    }
    float sums[MB * R];
    hsums<MB * R>(&acc[0][0], sums);
    for (int m = 0; m < MB; m++) {
      for (int r = 0; r < R; r++) {
        float s = sums[m * R + r];
        for (int k = KV; k < K; k++) {
          s += w[(size_t)r * K + k] * x[(size_t)m * K + k];
        }
        y[(size_t)m * N + n + r] = s;
      }
    }
  }
  if (n < n1) {
    f32_block<MB, 1>(W, x, y, n, n1, N, K);
  }
}

template <int MB>
static void f32_rows(const float* W, const float* x, float* y, int n0, int n1, int N, int K) {
  // With 32 registers: the blocks measured fastest on AVX-512; else whatever fits.
  constexpr int R = VREGS >= 32 ? (MB <= 2 ? 4 : (MB <= 4 ? 3 : 2)) : rows_fitting(MB, 1, 1);
  f32_block<MB, R>(W, x, y, n0, n1, N, K);
}

static void f32_dispatch(
    const float* W,
    const float* x,
    float* y,
    int M,
    int n0,
    int n1,
    int N,
    int K) {
  // x rows per pass over the weights: their accumulators must fit with one weight vector.
  constexpr int MBMAX = VREGS >= 32 ? 8 : std::max(1, VREGS - 2);
  for (int m0 = 0; m0 < M; m0 += MBMAX) {
    const float* xs = x + (size_t)m0 * K;
    float* ys = y + (size_t)m0 * N;
    switch (std::min(M - m0, MBMAX)) {
      case 1: f32_rows<1>(W, xs, ys, n0, n1, N, K); break;
      case 2: f32_rows<2>(W, xs, ys, n0, n1, N, K); break;
      case 3: f32_rows<3>(W, xs, ys, n0, n1, N, K); break;
      case 4: f32_rows<4>(W, xs, ys, n0, n1, N, K); break;
      case 5: f32_rows<5>(W, xs, ys, n0, n1, N, K); break;
      case 6: f32_rows<6>(W, xs, ys, n0, n1, N, K); break;
      case 7: f32_rows<7>(W, xs, ys, n0, n1, N, K); break;
      default: f32_rows<8>(W, xs, ys, n0, n1, N, K); break;
    }
  }
}

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

// Rows per chunk: ~64 KB of weights (a few microseconds), a multiple of 16 rows, and at
// least four chunks for the threads to share when the matrix allows.
static inline int chunk_rows(int N, int row_bytes) {
  int rows = std::max(16, (65536 / std::max(row_bytes, 1)) / 16 * 16);
  while (rows > 16 && (N + rows - 1) / rows < 4) {
    rows -= 16;
  }
  while ((N + rows - 1) / rows > 65535) {  // the pool counts chunks in 16 bits
    rows *= 2;
  }
  return rows;
}

void f32_products(const Product* products, int count) {
  if (count < 1 || count > 8) {
    throw std::invalid_argument("[macspec products] 1 to 8 products in one job");
  }
  int rows[8], first[9] = {0};
  for (int j = 0; j < count; j++) {
    rows[j] = chunk_rows(products[j].N, products[j].K * 4);
    first[j + 1] = first[j] + (products[j].N + rows[j] - 1) / rows[j];
  }
  if (count > 1 && first[count] > 65535) {  // the pool counts chunks in 16 bits
    for (int j = 0; j < count; j++) {
      f32_products(products + j, 1);
    }
    return;
  }
  Pool::get().run(first[count], [&](int c) {
    int j = 0;
    while (c >= first[j + 1]) {
      j++;
    }
    const Product& p = products[j];
    const int n0 = (c - first[j]) * rows[j];
    f32_dispatch(p.W, p.x, p.y, p.M, n0, std::min(p.N, n0 + rows[j]), p.N, p.K);
  });
}

// ---------------------------------------------------------------- the primitive

class SmallLinear : public mx::UnaryPrimitive {
 public:
  SmallLinear(mx::Stream stream, int bits, int group_size)
      : mx::UnaryPrimitive(stream), bits_(bits), group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    for (auto& a : inputs) {
      if (&a != &inputs[0] && !a.flags().row_contiguous) {
        throw std::runtime_error("[macspec linear] weights must be row-contiguous");
      }
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
    const int K = inputs[0].shape(-1);
    const int N = out.shape(-1);
    const int M = K ? inputs[0].size() / K : 0;
    float* y = out.data<float>();
    if (bits_ == 32) {
      encoder.dispatch([x = inputs[0], W = inputs[1].data<float>(), y, M, N, K]() {
        std::vector<float> scratch;
        const Product p{W, rows_of(x, scratch), y, M, N, K};
        f32_products(&p, 1);
      });
      return;
    }
    const auto& scales = inputs[2];
    switch (scales.dtype()) {
      case mx::float32: dispatch_q<float>(inputs, y, M, N, K, encoder); break;
      case mx::float16: dispatch_q<mx::float16_t>(inputs, y, M, N, K, encoder); break;
      case mx::bfloat16: dispatch_q<mx::bfloat16_t>(inputs, y, M, N, K, encoder); break;
      default: throw std::runtime_error("[macspec linear] unsupported scale type");
    }
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[macspec linear] CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  const char* name() const override {
    return "MacspecSmallLinear";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const SmallLinear&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_;
  }

 private:
  template <typename S>
  void dispatch_q(
      const std::vector<mx::array>& inputs,
      float* y,
      int M,
      int N,
      int K,
      mx::cpu::CommandEncoder& encoder) {
    encoder.dispatch([x = inputs[0],
                      Wq = inputs[1].data<uint8_t>(),
                      sc = inputs[2].data<S>(),
                      bi = inputs[3].data<S>(),
                      y,
                      M,
                      N,
                      K,
                      bits = bits_,
                      G = group_size_]() {
      std::vector<float> scratch;
      const float* xr = rows_of(x, scratch);
      // x reordered as the unpacking reads it, and its sum over each group.
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
    });
  }

  int bits_;
  int group_size_;
};

mx::array linear(const mx::array& x, const mx::array& w) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 || w.ndim() != 2 ||
      x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("[macspec linear] float32 x (..., K) and W (N, K)");
  }
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      shape, mx::float32, std::make_shared<SmallLinear>(cpu_stream(), 32, 0), {x, w});
}

mx::array qlinear(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits) {
  int K = x.shape(-1);
  if (x.dtype() != mx::float32 || w.dtype() != mx::uint32 || w.ndim() != 2 ||
      (bits != 4 && bits != 8) ||
      (group_size != 32 && group_size != 64 && group_size != 128) || K % group_size ||
      w.shape(1) * 32 / bits != K || scales.shape(0) != w.shape(0) ||
      scales.shape(1) != K / group_size || biases.shape() != scales.shape() ||
      biases.dtype() != scales.dtype()) {
    throw std::invalid_argument("[macspec qlinear] unsupported quantized layout");
  }
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      shape,
      mx::float32,
      std::make_shared<SmallLinear>(cpu_stream(), bits, group_size),
      {x, w, scales, biases});
}

void bind_layer(nb::module_& m);  // cpu_layer.cpp
void bind_block(nb::module_& m);  // cpu_block.cpp

}  // namespace macspec

NB_MODULE(_macspec_cpu, m) {
  m.doc() = "macspec's CPU kernels: products for a few rows, and the rest of a decoder layer";
  macspec::bind_layer(m);
  macspec::bind_block(m);
  m.def("linear", &macspec::linear, nb::arg("x"), nb::arg("w"));
  m.def(
      "qlinear",
      &macspec::qlinear,
      nb::arg("x"),
      nb::arg("w"),
      nb::arg("scales"),
      nb::arg("biases"),
      nb::arg("group_size"),
      nb::arg("bits"));
  m.def("threads", [] { return macspec::Pool::get().threads(); });
  m.def("set_threads", [](int n) { macspec::Pool::get().set_threads(n); });
  m.def("set_spin_us", [](int us) { macspec::Pool::get().set_spin_us(us); });
}
