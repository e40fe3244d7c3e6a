// The fused decoder layer's second primitive (cpu_block.cpp has the first, and the checks of
// the weights both take, block.h): the attention over the KV cache as updated, the output
// product, the residual, norm, the gate/up products, SwiGLU, the down product and the residual,
// for the rows of one sequence (AttnMlp) or of a shared pass's several (RowsAttnMlp). The kernels
// and their order are the single-op primitives' (cpu_layer.cpp, cpu_attention.cpp, cpu_linear.cpp
// and the quantized products): bit-identical results.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "block.h"
#include "common.h"
#include "kv.h"
#include "layer.h"
#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;

namespace macspec {

// y = h1 + mlp(norm(h1)), h1 = h + a @ Wo.T, for L rows of a (L, A): the matrices Wo, Wg, Wu, Wd
// from in[W0] on, the norm's weight `nw`.
static void project_mlp(const Mats& w, const std::vector<mx::array>& in, int W0, const float* h,
                        const float* nw, float eps, const float* a, int L, int D, float* y) {
  const int F = matrix_rows(in[W0 + w.arrays()]);
  const Room<MLP_ROWS> buf((size_t)L * (3 * D + 3 * F));
  float *o = buf.data(), *h1 = o + (size_t)L * D, *n = h1 + (size_t)L * D,
        *g = n + (size_t)L * D, *u = g + (size_t)L * F, *s = u + (size_t)L * F;
  const Job jo{0, a, o};
  run_products(w, in, W0, &jo, 1, L);
  for (size_t i = 0; i < (size_t)L * D; i++) {
    h1[i] = h[i] + o[i];
  }
  norm_rows(h1, nw, n, L, D, eps);
  const Job gu[2] = {{1, n, g}, {2, n, u}};
  run_products(w, in, W0, gu, 2, L);
  swiglu_n(g, u, s, (size_t)L * F);
  const Job jd{3, s, o};  // o is free again
  run_products(w, in, W0, &jd, 1, L);
  for (size_t i = 0; i < (size_t)L * D; i++) {
    y[i] = h1[i] + o[i];
  }
}

// (h, q, k, v, norm weight, Wo, Wg, Wu, Wd[, mask]) -> h + o + mlp(norm(h + o)), o being the
// attention's output projected (attend_rows; k and v are the cache's, read in place).
class AttnMlp : public LayerOp {
 public:
  static constexpr int W0 = 5;

  AttnMlp(mx::Stream s, Mats w, float scale, bool causal, float eps, bool mask)
      : LayerOp(s), w_(w), scale_(scale), causal_(causal), eps_(eps), mask_(mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_weights(inputs, W0, W0 + 4 * w_.arrays());
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([in = inputs, y = outputs[0].data<float>(), w = w_, scale = scale_,
                      causal = causal_, eps = eps_, has_mask = mask_]() {
      std::vector<float> hs, ws;
      const int L = in[0].shape(1), D = in[0].shape(2), A = cols(in, W0, w);
      const Room<ATTENDED_ROWS> a((size_t)L * A);
      attend_rows(in[1], in[2], in[3], has_mask ? in.back().data<bool>() : nullptr, scale,
                  causal, a.data());
      project_mlp(w, in, W0, rows_of(in[0], hs), rows_of(in[4], ws), eps, a.data(), L, D, y);
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
    return w_ == o.w_ && scale_ == o.scale_ && causal_ == o.causal_ && eps_ == o.eps_ &&
        mask_ == o.mask_;
  }

 private:
  Mats w_;
  float scale_;
  bool causal_;
  float eps_;
  bool mask_;
};

// A shared pass's layer after q/k/v (core/batch.py): (h (1, R*W, D), q (1, H, R*W, d), norm
// weight, Wo, Wg, Wu, Wd, k_0, v_0, ..., k_{R-1}, v_{R-1}) -> as AttnMlp, the ids r*W..(r+1)*W
// of h and q being row r's, attending over the first lengths[r] positions of row r's own cache
// buffers (k_r, v_r), causally: each row's ids get the bits AttnMlp gives them alone, its
// padding after them.
class RowsAttnMlp : public LayerOp {
 public:
  static constexpr int W0 = 3;

  RowsAttnMlp(mx::Stream s, Mats w, float scale, float eps, std::vector<int> lengths)
      : LayerOp(s), w_(w), scale_(scale), eps_(eps), lengths_(std::move(lengths)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_weights(inputs, W0, W0 + 4 * w_.arrays());
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([in = inputs, y = outputs[0].data<float>(), w = w_, scale = scale_,
                      eps = eps_, T = lengths_]() {
      std::vector<float> hs, qs, ws;
      const int L = in[0].shape(1), D = in[0].shape(2), H = in[1].shape(1), d = in[1].shape(3);
      const int R = T.size(), width = L / R, A = H * d, K0 = W0 + 4 * w.arrays();
      const float* qp = rows_of(in[1], qs);
      const Room<ATTENDED_ROWS> a((size_t)L * A);
      for (int r = 0; r < R; r++) {
        attend_query_rows(qp, H, L, r * width, width, d, in[K0 + 2 * r], in[K0 + 2 * r + 1], T[r],
                          nullptr, scale, width > 1, a.data() + (size_t)r * width * A);
      }
      project_mlp(w, in, W0, rows_of(in[0], hs), rows_of(in[2], ws), eps, a.data(), L, D, y);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override {
    return "MacspecRowsAttnMlp";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RowsAttnMlp&>(other);
    return w_ == o.w_ && scale_ == o.scale_ && eps_ == o.eps_ && lengths_ == o.lengths_;
  }

 private:
  Mats w_;
  float scale_;
  float eps_;
  std::vector<int> lengths_;
};

// The norm weight (D,), then Wo (D, A), Wg and Wu (F, D) and Wd (D, F), checked, onto `inputs`.
static void append_mlp(std::vector<mx::array>& inputs, const Mats& w, int D, int A,
                       const mx::array& norm, const std::vector<mx::array>& wo,
                       const std::vector<mx::array>& wg, const std::vector<mx::array>& wu,
                       const std::vector<mx::array>& wd) {
  check_matrix(wo, w, D, A, "Wo");
  const int F = check_matrix(wg, w, -1, D, "Wg");
  check_matrix(wu, w, F, D, "Wu");
  check_matrix(wd, w, D, F, "Wd");
  if (norm.ndim() != 1 || norm.shape(0) != D) {
    throw std::invalid_argument("[macspec block] norm weight of shape (D,)");
  }
  inputs.push_back(norm);
  for (auto* m : {&wo, &wg, &wu, &wd}) {
    append(inputs, *m);
  }
}

mx::array attn_mlp(
    const mx::array& h,
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::vector<mx::array>& wo,
    const mx::array& norm,
    float eps,
    const std::vector<mx::array>& wg,
    const std::vector<mx::array>& wu,
    const std::vector<mx::array>& wd,
    float scale,
    bool causal,
    std::optional<mx::array> mask,
    int bits,
    int group_size,
    bool int8) {
  const Mats w = layout(bits, group_size, int8);
  for (auto* a : {&h, &q, &norm}) {
    check_float32(*a, "h, q and norm weight");
  }
  check_kv(k, "k");
  check_kv(v, "v");
  if (h.ndim() != 3 || h.shape(0) != 1 || q.ndim() != 4 || k.ndim() != 4 ||
      k.shape() != v.shape() || q.shape(2) != h.shape(1) || q.shape(3) != k.shape(3) ||
      k.shape(1) <= 0 || q.shape(1) % k.shape(1) || k.shape(2) < q.shape(2)) {
    throw std::invalid_argument(
        "[macspec attn_mlp] h (1, L, D), q (1, H, L, d) and k, v (1, KVH, T >= L, d)");
  }
  std::vector<mx::array> inputs = {h, q, k, v};
  append_mlp(inputs, w, h.shape(2), q.shape(1) * q.shape(3), norm, wo, wg, wu, wd);
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->size() != (size_t)q.shape(2) * k.shape(2)) {
      throw std::invalid_argument("[macspec attn_mlp] a boolean mask of shape (L, T)");
    }
    inputs.push_back(mx::contiguous(mx::reshape(*mask, {q.shape(2), k.shape(2)})));
  }
  return mx::array::make_arrays(
      {h.shape()},
      {mx::float32},
      std::make_shared<AttnMlp>(cpu_stream(), w, scale, causal, eps, mask.has_value()),
      inputs)[0];
}

mx::array rows_attn_mlp(
    const mx::array& h,
    const mx::array& q,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths,
    const std::vector<mx::array>& wo,
    const mx::array& norm,
    float eps,
    const std::vector<mx::array>& wg,
    const std::vector<mx::array>& wu,
    const std::vector<mx::array>& wd,
    float scale,
    int bits,
    int group_size,
    bool int8) {
  const Mats w = layout(bits, group_size, int8);
  for (auto* a : {&h, &q, &norm}) {
    check_float32(*a, "h, q and norm weight");
  }
  const int R = keys.size();
  if (h.ndim() != 3 || h.shape(0) != 1 || q.ndim() != 4 || q.shape(0) != 1 ||
      q.shape(2) != h.shape(1) || R < 1 || values.size() != keys.size() ||
      lengths.size() != keys.size() || h.shape(1) % R) {
    throw std::invalid_argument(
        "[macspec rows_attn_mlp] h (1, R*W, D), q (1, H, R*W, d), R keys, values and lengths");
  }
  for (int r = 0; r < R; r++) {
    const auto &k = keys[r], &v = values[r];
    check_kv(k, "k");
    check_kv(v, "v");
    if (k.ndim() != 4 || k.shape() != v.shape() || k.shape(3) != q.shape(3) || k.shape(1) <= 0 ||
        q.shape(1) % k.shape(1) || lengths[r] < h.shape(1) / R || k.shape(2) < lengths[r]) {
      throw std::invalid_argument(
          "[macspec rows_attn_mlp] k, v (1, KVH, >= length, d) each, every length >= W");
    }
  }
  std::vector<mx::array> inputs = {h, q};
  append_mlp(inputs, w, h.shape(2), q.shape(1) * q.shape(3), norm, wo, wg, wu, wd);
  for (int r = 0; r < R; r++) {
    inputs.push_back(keys[r]);
    inputs.push_back(values[r]);
  }
  return mx::array::make_arrays(
      {h.shape()}, {mx::float32},
      std::make_shared<RowsAttnMlp>(cpu_stream(), w, scale, eps, lengths), inputs)[0];
}

void bind_attn_mlp(nb::module_& m) {
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
      nb::arg("mask") = nb::none(),
      nb::arg("bits") = 32,
      nb::arg("group_size") = 0,
      nb::arg("int8") = false);
  m.def(
      "rows_attn_mlp",
      &rows_attn_mlp,
      nb::arg("h"),
      nb::arg("q"),
      nb::arg("keys"),
      nb::arg("values"),
      nb::arg("lengths"),
      nb::arg("wo"),
      nb::arg("norm"),
      nb::arg("eps"),
      nb::arg("wg"),
      nb::arg("wu"),
      nb::arg("wd"),
      nb::arg("scale"),
      nb::arg("bits") = 32,
      nb::arg("group_size") = 0,
      nb::arg("int8") = false);
}

}  // namespace macspec
