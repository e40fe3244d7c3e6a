// A llama/qwen2 decoder layer of a few rows as two primitives around the KV cache's update:
// (norm, the q/k/v products, RoPE) and (attention, the output product, the residual, norm, the
// gate/up products, SwiGLU, the down product, the residual). On MLX's CPU backend every op costs
// the Python thread an allocation and a hand-off to the stream (~19 us here all told), and on a
// 2-core CPU that thread takes its core from the products: 17 ops a layer become 6.
//
// The kernels are the ones the single-op primitives run (cpu_layer.cpp, cpu_attention.cpp,
// cpu_linear.cpp), in the same order, so the results are bit-identical to theirs.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "layer.h"
#include "linear.h"
#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;

namespace macspec {

static void check_weights(const std::vector<mx::array>& inputs, size_t from, size_t to) {
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

// (h, norm weight, Wq, Wk, Wv, cos, sin[, bq, bk, bv][, positions]) -> q, k, v as rope_heads
// gives them: (1, heads, L, D) with RoPE applied to q and k.
class QkvRope : public LayerOp {
 public:
  QkvRope(mx::Stream s, float eps, int heads, int kv_heads, int offset, bool traditional,
          bool bias, bool positions)
      : LayerOp(s), eps_(eps), heads_(heads), kv_heads_(kv_heads), offset_(offset),
        traditional_(traditional), bias_(bias), positions_(positions) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_weights(inputs, 1, 5);
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([in = inputs, qo = outputs[0].data<float>(), ko = outputs[1].data<float>(),
                      vo = outputs[2].data<float>(), eps = eps_, H = heads_, KVH = kv_heads_,
                      offset = offset_, traditional = traditional_, bias = bias_,
                      has_positions = positions_]() {
      std::vector<float> hs, ws, cs, ss;
      const int L = in[0].shape(1), D = in[0].shape(2);
      const int Nq = in[2].shape(0), Nk = in[3].shape(0);
      std::vector<float> buf((size_t)L * (D + Nq + 2 * Nk));
      float *normed = buf.data(), *q = normed + (size_t)L * D, *k = q + (size_t)L * Nq,
            *v = k + (size_t)L * Nk;
      norm_rows(rows_of(in[0], hs), rows_of(in[1], ws), normed, L, D, eps);
      const Product p[3] = {{in[2].data<float>(), normed, q, L, Nq, D},
                            {in[3].data<float>(), normed, k, L, Nk, D},
                            {in[4].data<float>(), normed, v, L, Nk, D}};
      f32_products(p, 3);
      if (bias) {
        add_rows(q, in[7].data<float>(), L, Nq);
        add_rows(k, in[8].data<float>(), L, Nk);
        add_rows(v, in[9].data<float>(), L, Nk);
      }
      const int32_t* positions = has_positions ? in.back().data<int32_t>() : nullptr;
      rope_rows(q, k, v, rows_of(in[5], cs), rows_of(in[6], ss), in[5].shape(1), positions,
                offset, L, H, KVH, Nq / H, traditional, qo, ko, vo);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int L = inputs[0].shape(1), D = inputs[2].shape(0) / heads_;
    return {{1, heads_, L, D}, {1, kv_heads_, L, D}, {1, kv_heads_, L, D}};
  }
  const char* name() const override {
    return "MacspecQkvRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QkvRope&>(other);
    return eps_ == o.eps_ && heads_ == o.heads_ && kv_heads_ == o.kv_heads_ &&
        offset_ == o.offset_ && traditional_ == o.traditional_ && bias_ == o.bias_ &&
        positions_ == o.positions_;
  }

 private:
  float eps_;
  int heads_, kv_heads_, offset_;
  bool traditional_, bias_, positions_;
};

// (h, q, k, v, Wo, norm weight, Wg, Wu, Wd[, mask]) -> h + o + mlp(norm(h + o)), o being the
// attention's output projected (attend_rows; k and v are the cache's, read in place).
class AttnMlp : public LayerOp {
 public:
  AttnMlp(mx::Stream s, float scale, bool causal, float eps, bool mask)
      : LayerOp(s), scale_(scale), causal_(causal), eps_(eps), mask_(mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_weights(inputs, 4, 9);
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([in = inputs, y = outputs[0].data<float>(), scale = scale_, causal = causal_,
                      eps = eps_, has_mask = mask_]() {
      std::vector<float> hs, ws;
      const float* h = rows_of(in[0], hs);
      const int L = in[0].shape(1), D = in[0].shape(2), A = in[4].shape(1), F = in[6].shape(0);
      std::vector<float> buf((size_t)L * (A + 3 * D + 3 * F));
      float *a = buf.data(), *o = a + (size_t)L * A, *h1 = o + (size_t)L * D,
            *n = h1 + (size_t)L * D, *g = n + (size_t)L * D, *u = g + (size_t)L * F,
            *s = u + (size_t)L * F;
      attend_rows(in[1], in[2], in[3], has_mask ? in[9].data<bool>() : nullptr, scale, causal, a);
      const Product po{in[4].data<float>(), a, o, L, D, A};
      f32_products(&po, 1);
      for (size_t i = 0; i < (size_t)L * D; i++) {
        h1[i] = h[i] + o[i];
      }
      norm_rows(h1, rows_of(in[5], ws), n, L, D, eps);
      const Product gu[2] = {{in[6].data<float>(), n, g, L, F, D},
                             {in[7].data<float>(), n, u, L, F, D}};
      f32_products(gu, 2);
      swiglu_n(g, u, s, (size_t)L * F);
      const Product pd{in[8].data<float>(), s, o, L, D, F};  // o is free again
      f32_products(&pd, 1);
      for (size_t i = 0; i < (size_t)L * D; i++) {
        y[i] = h1[i] + o[i];
      }
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override {
    return "MacspecAttnMlp";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttnMlp&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && eps_ == o.eps_ && mask_ == o.mask_;
  }

 private:
  float scale_;
  bool causal_;
  float eps_;
  bool mask_;
};

static void check_matrix(const mx::array& w, int N, int K, const char* what) {
  check_float32(w, what);
  if (w.ndim() != 2 || (N >= 0 && w.shape(0) != N) || w.shape(1) != K) {
    throw std::invalid_argument(std::string("[macspec block] ") + what + " of the wrong shape");
  }
}

std::vector<mx::array> qkv_rope(
    const mx::array& h,
    const mx::array& norm,
    float eps,
    const mx::array& wq,
    const mx::array& wk,
    const mx::array& wv,
    const mx::array& cos,
    const mx::array& sin,
    int heads,
    int kv_heads,
    int offset,
    bool traditional,
    std::optional<std::vector<mx::array>> biases,
    std::optional<mx::array> positions) {
  check_float32(h, "h");
  if (h.ndim() != 3 || h.shape(0) != 1 || heads <= 0 || kv_heads <= 0) {
    throw std::invalid_argument("[macspec qkv_rope] h of shape (1, L, D)");
  }
  const int L = h.shape(1), D = h.shape(2);
  check_matrix(wq, -1, D, "Wq");
  const int Nq = wq.shape(0);
  check_matrix(wk, Nq / heads * kv_heads, D, "Wk");
  check_matrix(wv, Nq / heads * kv_heads, D, "Wv");
  check_float32(norm, "norm weight");
  if (Nq % heads || norm.ndim() != 1 || norm.shape(0) != D) {
    throw std::invalid_argument("[macspec qkv_rope] norm weight (D,) and Wq (heads * d, D)");
  }
  check_float32(cos, "cos");
  check_float32(sin, "sin");
  if (cos.ndim() != 2 || cos.shape() != sin.shape() || 2 * cos.shape(1) > Nq / heads) {
    throw std::invalid_argument("[macspec qkv_rope] cos/sin tables (positions, dims / 2)");
  }
  std::vector<mx::array> inputs = {h, norm, wq, wk, wv, cos, sin};
  if (biases) {
    if (biases->size() != 3) {
      throw std::invalid_argument("[macspec qkv_rope] three biases (q, k, v)");
    }
    const int sizes[3] = {Nq, wk.shape(0), wk.shape(0)};
    for (int i = 0; i < 3; i++) {
      const auto& b = (*biases)[i];
      check_float32(b, "bias");
      if (b.ndim() != 1 || b.shape(0) != sizes[i]) {
        throw std::invalid_argument("[macspec qkv_rope] a bias of the wrong shape");
      }
      inputs.push_back(mx::contiguous(b));
    }
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
  return mx::array::make_arrays(
      {{1, heads, L, d}, {1, kv_heads, L, d}, {1, kv_heads, L, d}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<QkvRope>(cpu_stream(), eps, heads, kv_heads, offset, traditional,
                                biases.has_value(), positions.has_value()),
      inputs);
}

mx::array attn_mlp(
    const mx::array& h,
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& wo,
    const mx::array& norm,
    float eps,
    const mx::array& wg,
    const mx::array& wu,
    const mx::array& wd,
    float scale,
    bool causal,
    std::optional<mx::array> mask) {
  for (auto* a : {&h, &q, &k, &v, &norm}) {
    check_float32(*a, "h, q, k, v and norm weight");
  }
  if (h.ndim() != 3 || h.shape(0) != 1 || q.ndim() != 4 || k.ndim() != 4 ||
      k.shape() != v.shape() || q.shape(2) != h.shape(1) || q.shape(3) != k.shape(3) ||
      k.shape(1) <= 0 || q.shape(1) % k.shape(1) || k.shape(2) < q.shape(2)) {
    throw std::invalid_argument(
        "[macspec attn_mlp] h (1, L, D), q (1, H, L, d) and k, v (1, KVH, T >= L, d)");
  }
  const int D = h.shape(2), F = wg.shape(0);
  check_matrix(wo, D, q.shape(1) * q.shape(3), "Wo");
  check_matrix(wg, -1, D, "Wg");
  check_matrix(wu, F, D, "Wu");
  check_matrix(wd, D, F, "Wd");
  if (norm.ndim() != 1 || norm.shape(0) != D) {
    throw std::invalid_argument("[macspec attn_mlp] norm weight of shape (D,)");
  }
  std::vector<mx::array> inputs = {h, q, k, v, wo, norm, wg, wu, wd};
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->size() != (size_t)q.shape(2) * k.shape(2)) {
      throw std::invalid_argument("[macspec attn_mlp] a boolean mask of shape (L, T)");
    }
    inputs.push_back(mx::contiguous(mx::reshape(*mask, {q.shape(2), k.shape(2)})));
  }
  return mx::array::make_arrays(
      {h.shape()},
      {mx::float32},
      std::make_shared<AttnMlp>(cpu_stream(), scale, causal, eps, mask.has_value()),
      inputs)[0];
}

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
      nb::arg("positions") = nb::none());
  m.def(
      "attn_mlp",
      &attn_mlp,
      nb::arg("h"),
      nb::arg("q"),
      nb::arg("k"),
      nb::arg("v"),
      nb::arg("wo"),
      nb::arg("norm"),
      nb::arg("eps"),
      nb::arg("wg"),
      nb::arg("wu"),
      nb::arg("wd"),
      nb::arg("scale"),
      nb::arg("causal"),
      nb::arg("mask") = nb::none());
}

}  // namespace macspec
