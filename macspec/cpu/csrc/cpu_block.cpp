// A llama/qwen2 decoder layer of a few rows as two primitives around the KV cache's update:
// (norm, the q/k/v products, RoPE), here, and (attention, the output product, the residual, norm,
// the gate/up products, SwiGLU, the down product, the residual), cpu_attn_mlp.cpp. On MLX's CPU
// backend every op costs the Python thread an allocation and a hand-off to the stream, and on a
// 2-core CPU that thread takes its core from the products: 17 ops a
// layer become 6.
//
// The weights are float32 or MLX's affine 4/8-bit layout, all of a layer's alike (block.h's Mats,
// checked here). The kernels are the ones the single-op primitives run (cpu_layer.cpp,
// cpu_attention.cpp, cpu_linear.cpp and the quantized products), in the same order, so the
// results are bit-identical to theirs; a primitive's products of the same input run as one job
// of the thread pool.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "block.h"
#include "common.h"
#include "kv.h"
#include "layer.h"
#include "linear.h"
#include "quant.h"
#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;

namespace macspec {

void run_products(const Mats& w, const std::vector<mx::array>& in, int first, const Job* jobs,
                  int count, int M) {
  if (w.bits == 32) {
    Product p[MAX_JOINED];
    for (int j = 0; j < count; j++) {
      const mx::array& a = in[first + jobs[j].matrix];
      p[j] = {a.data<float>(), jobs[j].x, jobs[j].y, M, a.shape(0), a.shape(1)};
    }
    f32_products(p, count);
    return;
  }
  QProduct q[MAX_JOINED];
  for (int j = 0; j < count; j++) {
    const size_t i = first + 3 * jobs[j].matrix;
    const mx::array& a = in[i];
    q[j] = {a.data<uint8_t>(), in[i + 1].data<void>(), in[i + 2].data<void>(),
            scale_type(in[i + 1].dtype()), jobs[j].x, jobs[j].y, M, matrix_rows(a),
            cols(in, i, w), bits_of(in, i, w), w.group, a.ndim() == 3};
  }
  if (w.int8) {
    q_int8_products(q, count);
  } else {
    q_float_products(q, count);
  }
}

void check_weights(const std::vector<mx::array>& inputs, size_t from, size_t to) {
  for (size_t i = from; i < to && i < inputs.size(); i++) {
    if (!inputs[i].flags().row_contiguous) {
      throw std::runtime_error("[macspec block] weights must be row-contiguous");
    }
  }
}

static void add_rows(float* y, const float* b, int rows, int N) {  // y += b, row by row
  for (int m = 0; m < rows; m++) {
    for (int n = 0; n < N; n++) {
      y[(size_t)m * N + n] += b[n];
    }
  }
}

// (h, norm weight, cos, sin, Wq, Wk, Wv[, bq, bk, bv][, positions]) -> q, k, v as rope_heads
// gives them: (1, heads, L, D) with RoPE applied to q and k.
class QkvRope : public LayerOp {
 public:
  static constexpr int W0 = 4;  // the first weight array

  QkvRope(mx::Stream s, Mats w, float eps, int heads, int kv_heads, int offset, bool traditional,
          bool bias, bool positions, bool half)
      : LayerOp(s), w_(w), eps_(eps), heads_(heads), kv_heads_(kv_heads), offset_(offset),
        traditional_(traditional), bias_(bias), positions_(positions), half_(half) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_weights(inputs, W0, W0 + 3 * w_.arrays());
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([in = inputs, qo = outputs[0].data<float>(), kb = outputs[1].data<char>(),
                      vb = outputs[2].data<char>(), w = w_, eps = eps_, H = heads_,
                      KVH = kv_heads_, offset = offset_, traditional = traditional_,
                      bias = bias_, has_positions = positions_, half = half_]() {
      std::vector<float> hs, ws, cs, ss;
      const int L = in[0].shape(1), D = in[0].shape(2), B0 = W0 + 3 * w.arrays();
      const int Nq = matrix_rows(in[W0]), Nk = matrix_rows(in[W0 + w.arrays()]);
      const Room<QKV_ROWS> buf((size_t)L * (D + Nq + 2 * Nk));
      float *normed = buf.data(), *q = normed + (size_t)L * D, *k = q + (size_t)L * Nq,
            *v = k + (size_t)L * Nk;
      norm_rows(rows_of(in[0], hs), rows_of(in[1], ws), normed, L, D, eps);
      const Job jobs[3] = {{0, normed, q}, {1, normed, k}, {2, normed, v}};
      run_products(w, in, W0, jobs, 3, L);
      if (bias) {
        add_rows(q, in[B0].data<float>(), L, Nq);
        add_rows(k, in[B0 + 1].data<float>(), L, Nk);
        add_rows(v, in[B0 + 2].data<float>(), L, Nk);
      }
      const int32_t* positions = has_positions ? in.back().data<int32_t>() : nullptr;
      // With `half`, k and v as a float16 cache keeps them (rope_heads, cpu_layer.cpp)
      NewKV kv(kb, vb, (size_t)L * Nk, half);
      rope_rows(q, k, v, rows_of(in[2], cs), rows_of(in[3], ss), in[2].shape(1), positions,
                offset, L, H, KVH, Nq / H, traditional, qo, kv.k, kv.v);
      kv.store();
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int L = inputs[0].shape(1), D = matrix_rows(inputs[W0]) / heads_;
    return {{1, heads_, L, D}, {1, kv_heads_, L, D}, {1, kv_heads_, L, D}};
  }
  const char* name() const override {
    return "MacspecQkvRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QkvRope&>(other);
    return w_ == o.w_ && eps_ == o.eps_ && heads_ == o.heads_ && kv_heads_ == o.kv_heads_ &&
        offset_ == o.offset_ && traditional_ == o.traditional_ && bias_ == o.bias_ &&
        positions_ == o.positions_ && half_ == o.half_;
  }

 private:
  Mats w_;
  float eps_;
  int heads_, kv_heads_, offset_;
  bool traditional_, bias_, positions_, half_;
};

static std::invalid_argument refused(const char* what, const char* why) {
  return std::invalid_argument(std::string("[macspec block] ") + what + why);
}

Mats layout(int bits, int group_size, bool int8) {
  if (bits == 32) {
    return {};
  }
  if ((bits != 4 && bits != 8) || (group_size != 32 && group_size != 64 && group_size != 128)) {
    throw refused("weights", " of 32 bits, or 4 or 8 in groups of 32, 64 or 128");
  }
  return {bits, group_size, int8 && int8_isa() != nullptr};
}

// Weights, scales and biases repacked at load (cpu_q4packed.cpp), in the shapes it names, where
// this build takes them.
static bool packed_layout(const std::vector<mx::array>& m, const Mats& w) {
  const int bits = bits_of(m, 0, w);
  return w.bits != 32 && m[0].ndim() == 3 && (bits == 4 || (bits == 8 && q8_packs())) &&
         w.int8 && q4_packs() && packed_shapes(m[0], m[1]);
}

int check_matrix(const std::vector<mx::array>& m, const Mats& w, int N, int K, const char* what) {
  if (m.size() != (size_t)w.arrays()) {
    throw refused(what, w.bits == 32 ? ": one array" : ": weights, scales and biases");
  }
  const mx::array& a = m[0];
  if (w.bits == 32) {
    check_float32(a, what);
  } else if (a.dtype() != mx::uint32 || m[1].ndim() != a.ndim() || m[2].shape() != m[1].shape() ||
             m[2].dtype() != m[1].dtype() ||
             !(m[1].dtype() == mx::float32 || m[1].dtype() == mx::float16 ||
               m[1].dtype() == mx::bfloat16 || (m[1].dtype() == mx::int8 && a.ndim() == 3))) {
    throw refused(what, ": uint32 weights, and scales and biases of one type and shape");
  }
  const int bits = bits_of(m, 0, w);
  if (!(a.ndim() == 2 || packed_layout(m, w)) || (N >= 0 && matrix_rows(a) != N) ||
      cols(m, 0, w) != K || (bits != 32 && bits != 4 && bits != 8) ||
      (w.bits != 32 && a.ndim() == 2 &&
       (K % w.group || m[1].shape(0) != a.shape(0) || m[1].shape(1) != K / w.group))) {
    throw refused(what, " of the wrong shape");
  }
  return matrix_rows(a);
}

static void check_rope(const mx::array& h, const mx::array& norm, const mx::array& cos,
                       const mx::array& sin, int heads, int kv_heads, int Nq) {
  check_float32(h, "h");
  if (h.ndim() != 3 || h.shape(0) != 1 || heads <= 0 || kv_heads <= 0) {
    throw std::invalid_argument("[macspec qkv_rope] h of shape (1, L, D)");
  }
  check_float32(norm, "norm weight");
  if (Nq % heads || norm.ndim() != 1 || norm.shape(0) != h.shape(2)) {
    throw std::invalid_argument("[macspec qkv_rope] norm weight (D,) and Wq (heads * d, D)");
  }
  check_float32(cos, "cos");
  check_float32(sin, "sin");
  if (cos.ndim() != 2 || cos.shape() != sin.shape() || 2 * cos.shape(1) > Nq / heads) {
    throw std::invalid_argument("[macspec qkv_rope] cos/sin tables (positions, dims / 2)");
  }
}

static void append_biases(std::vector<mx::array>& inputs, const std::vector<mx::array>& biases,
                          int Nq, int Nk) {
  if (biases.size() != 3) {
    throw std::invalid_argument("[macspec qkv_rope] three biases (q, k, v)");
  }
  const int sizes[3] = {Nq, Nk, Nk};
  for (int i = 0; i < 3; i++) {
    const auto& b = biases[i];
    check_float32(b, "bias");
    if (b.ndim() != 1 || b.shape(0) != sizes[i]) {
      throw std::invalid_argument("[macspec qkv_rope] a bias of the wrong shape");
    }
    inputs.push_back(mx::contiguous(b));
  }
}

std::vector<mx::array> qkv_rope(
    const mx::array& h,
    const mx::array& norm,
    float eps,
    const std::vector<mx::array>& wq,
    const std::vector<mx::array>& wk,
    const std::vector<mx::array>& wv,
    const mx::array& cos,
    const mx::array& sin,
    int heads,
    int kv_heads,
    int offset,
    bool traditional,
    std::optional<std::vector<mx::array>> biases,
    std::optional<mx::array> positions,
    int bits,
    int group_size,
    bool int8,
    bool half) {
  const Mats w = layout(bits, group_size, int8);
  if (h.ndim() != 3) {
    throw std::invalid_argument("[macspec qkv_rope] h of shape (1, L, D)");
  }
  const int L = h.shape(1), D = h.shape(2);
  const int Nq = check_matrix(wq, w, -1, D, "Wq");
  check_rope(h, norm, cos, sin, heads, kv_heads, Nq);
  const int Nk = check_matrix(wk, w, Nq / heads * kv_heads, D, "Wk");
  check_matrix(wv, w, Nk, D, "Wv");
  std::vector<mx::array> inputs = {h, norm, cos, sin};
  for (auto* m : {&wq, &wk, &wv}) {
    append(inputs, *m);
  }
  if (biases) {
    append_biases(inputs, *biases, Nq, Nk);
  }
  if (positions) {
    if (positions->dtype() != mx::int32 || positions->size() != (size_t)L) {
      throw std::invalid_argument("[macspec qkv_rope] int32 positions, one per row");
    }
    inputs.push_back(mx::contiguous(*positions));
  } else if (offset < 0 || offset + L > cos.shape(0)) {
    throw std::invalid_argument("[macspec qkv_rope] positions past the table");
  }
  const int d = Nq / heads;
  const mx::Dtype kv = half ? mx::float16 : mx::float32;
  return mx::array::make_arrays(
      {{1, heads, L, d}, {1, kv_heads, L, d}, {1, kv_heads, L, d}},
      {mx::float32, kv, kv},
      std::make_shared<QkvRope>(cpu_stream(), w, eps, heads, kv_heads, offset, traditional,
                                biases.has_value(), positions.has_value(), half),
      inputs);
}

void bind_attn_mlp(nb::module_& m);  // cpu_attn_mlp.cpp

void bind_block(nb::module_& m) {
  m.def(
      "qkv_rope",
      &qkv_rope,
      nb::arg("h"),
      nb::arg("norm"),
      nb::arg("eps"),
      nb::arg("wq"),
      nb::arg("wk"),
      nb::arg("wv"),
      nb::arg("cos"),
      nb::arg("sin"),
      nb::arg("heads"),
      nb::arg("kv_heads"),
      nb::arg("offset"),
      nb::arg("traditional"),
      nb::arg("biases") = nb::none(),
      nb::arg("positions") = nb::none(),
      nb::arg("bits") = 32,
      nb::arg("group_size") = 0,
      nb::arg("int8") = false,
      nb::arg("half") = false);
  bind_attn_mlp(m);
}

}  // namespace macspec
