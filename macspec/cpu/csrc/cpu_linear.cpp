// Matrix products for a few rows on MLX's CPU backend: y = x @ W.T for float32 W, and for MLX's
// affine 4- and 8-bit quantized W (their kernels: cpu_qfloat.cpp and cpu_qint8.cpp). One pass over
// the weights serves every row (verifying K drafts reads them once), split over the cores. Built on
// the user's machine by macspec/cpu/native.py with -march=native; macspec falls back to mlx's own
// ops without it.
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
#include "quant.h"
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

void f32_products(const Product* products, int count) {
  int N[8], row_bytes[8];
  for (int j = 0; j < count && j < 8; j++) {
    N[j] = products[j].N;
    row_bytes[j] = products[j].K * 4;
  }
  run_joined(N, row_bytes, count, [&](int j, int n0, int n1) {
    const Product& p = products[j];
    f32_dispatch(p.W, p.x, p.y, p.M, n0, n1, p.N, p.K);
  });
}

// ---------------------------------------------------------------- the primitive

class SmallLinear : public mx::UnaryPrimitive {
 public:
  // bits 32: float32 W; 4 or 8: MLX's affine layout, with int8 activations if `int8`.
  SmallLinear(mx::Stream stream, int bits, int group_size, bool int8 = false)
      : mx::UnaryPrimitive(stream), bits_(bits), group_size_(group_size), int8_(int8) {}

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
    QProduct q{inputs[1].data<uint8_t>(), inputs[2].data<void>(), inputs[3].data<void>(),
               scale_type(inputs[2].dtype()), nullptr, y, M, N, K, bits_, group_size_,
               inputs[1].ndim() == 3};
    encoder.dispatch([x = inputs[0], q, int8 = int8_ && int8_isa() != nullptr]() mutable {
      std::vector<float> scratch;
      q.x = rows_of(x, scratch);
      if (int8) {
        q_int8_products(&q, 1);
      } else {
        q_float_products(&q, 1);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[macspec linear] CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = matrix_rows(inputs[1]);
    return {shape};
  }

  const char* name() const override {
    return "MacspecSmallLinear";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const SmallLinear&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && int8_ == o.int8_;
  }

 private:
  int bits_;
  int group_size_;
  bool int8_;
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

// qlinear for weights repacked at load (cpu_q4packed.cpp): int8 products only.
mx::array packed_qlinear(const mx::array& x, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits, bool int8) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::uint32 || !(bits == 4 || bits == 8) ||
      (bits == 8 && !q8_packs()) || group_size != w.shape(2) * 2 / bits || !int8 ||
      !q4_packs() || !packed_shapes(w, scales) ||
      x.shape(-1) != matrix_cols(w, bits) ||
      biases.shape() != scales.shape() || biases.dtype() != scales.dtype()) {
    throw std::invalid_argument(
        "[macspec qlinear] repacked weights: 4 or 8 bits, groups of 32 or 64, int8");
  }
  auto shape = x.shape();
  shape.back() = matrix_rows(w);
  return mx::array(shape, mx::float32,
                   std::make_shared<SmallLinear>(cpu_stream(), bits, group_size, int8),
                   {x, w, scales, biases});
}

mx::array qlinear(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    bool int8) {
  int K = x.shape(-1);
  if (w.ndim() == 3) {
    return packed_qlinear(x, w, scales, biases, group_size, bits, int8);
  }
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
      std::make_shared<SmallLinear>(cpu_stream(), bits, group_size, int8),
      {x, w, scales, biases});
}

void bind_layer(nb::module_& m);  // cpu_layer.cpp
void bind_sample(nb::module_& m);  // cpu_sample.cpp
void bind_block(nb::module_& m);  // cpu_block.cpp

}  // namespace macspec

NB_MODULE(_macspec_cpu, m) {
  m.doc() = "macspec's CPU kernels: products for a few rows, and the rest of a decoder layer";
  macspec::bind_layer(m);
  macspec::bind_sample(m);
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
      nb::arg("bits"),
      nb::arg("int8") = false);
  m.def("q4_packs", &macspec::q4_packs);  // whether qlinear takes 4-bit weights repacked
  m.def("q8_packs", &macspec::q8_packs);  // and 8-bit ones
  m.def("int8_isa", []() -> nb::object {  // the int8 products' instructions, or None
    const char* isa = macspec::int8_isa();
    return isa ? nb::object(nb::str(isa)) : nb::none();
  });
  m.def("threads", [] { return macspec::Pool::get().threads(); });
  m.def("set_threads", [](int n) { macspec::Pool::get().set_threads(n); });
  m.def("set_spin_us", [](int us) { macspec::Pool::get().set_spin_us(us); });
}
