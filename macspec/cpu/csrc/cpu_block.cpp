// A llama/qwen2 decoder layer of a few rows as two primitives around the KV cache's update:
// (norm, the q/k/v products, RoPE) and (attention, the output product, the residual, norm, the
// gate/up products, SwiGLU, the down product, the residual). On MLX's CPU backend every op costs
// the Python thread an allocation and a hand-off to the stream (~19 us here all told), and on a
// 2-core CPU that thread takes its core from the products: 17 ops a layer become 6.
//
// The weights are float32 or MLX's affine 4/8-bit layout, all of a layer's alike. The kernels are
// the ones the single-op primitives run (cpu_layer.cpp, cpu_attention.cpp, cpu_linear.cpp and the
// quantized products), in the same order, so the results are bit-identical to theirs; a
// primitive's products of the same input run as one job of the thread pool.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common.h"
#include "layer.h"
#include "linear.h"
#include "quant.h"
#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;

namespace macspec {

// How a block's weight matrices are stored: float32 (one array each; bits 32) or MLX's affine
// layout (packed weights, scales, biases), and whether the quantized products take int8 x.
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
static void run_products(const Mats& w, const std::vector<mx::array>& in, int first,
                         const Job* jobs, int count, int M) {
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
            matrix_cols(a, w.bits), w.bits, w.group, a.ndim() == 3};
  }
  if (w.int8) {
    q_int8_products(q, count);
  } else {
    q_float_products(q, count);
  }
}

static int cols(const mx::array& w, const Mats& m) {  // K of a matrix stored as w
  return matrix_cols(w, m.bits);
}

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

// (h, norm weight, cos, sin, Wq, Wk, Wv[, bq, bk, bv][, positions]) -> q, k, v as rope_heads
// gives them: (1, heads, L, D) with RoPE applied to q and k.
class QkvRope : public LayerOp {
 public:
  static constexpr int W0 = 4;  // the first weight array

  QkvRope(mx::Stream s, Mats w, float eps, int heads, int kv_heads, int offset, bool traditional,
          bool bias, bool positions)
      : LayerOp(s), w_(w), eps_(eps), heads_(heads), kv_heads_(kv_heads), offset_(offset),
        traditional_(traditional), bias_(bias), positions_(positions) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_weights(inputs, W0, W0 + 3 * w_.arrays());
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([in = inputs, qo = outputs[0].data<float>(), ko = outputs[1].data<float>(),
                      vo = outputs[2].data<float>(), w = w_, eps = eps_, H = heads_,
                      KVH = kv_heads_, offset = offset_, traditional = traditional_,
                      bias = bias_, has_positions = positions_]() {
      std::vector<float> hs, ws, cs, ss;
      const int L = in[0].shape(1), D = in[0].shape(2), B0 = W0 + 3 * w.arrays();
      const int Nq = matrix_rows(in[W0]), Nk = matrix_rows(in[W0 + w.arrays()]);
      std::vector<float> buf((size_t)L * (D + Nq + 2 * Nk));
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
      rope_rows(q, k, v, rows_of(in[2], cs), rows_of(in[3], ss), in[2].shape(1), positions,
                offset, L, H, KVH, Nq / H, traditional, qo, ko, vo);
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
        positions_ == o.positions_;
  }

 private:
  Mats w_;
  float eps_;
  int heads_, kv_heads_, offset_;
  bool traditional_, bias_, positions_;
};

// y = h1 + mlp(norm(h1)), h1 = h + a @ Wo.T, for L rows of a (L, A): the matrices Wo, Wg, Wu, Wd
// from in[W0] on, the norm's weight `nw`.
static void project_mlp(const Mats& w, const std::vector<mx::array>& in, int W0, const float* h,
                        const float* nw, float eps, const float* a, int L, int D, float* y) {
  const int F = matrix_rows(in[W0 + w.arrays()]);
  std::vector<float> buf((size_t)L * (3 * D + 3 * F));
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
      const int L = in[0].shape(1), D = in[0].shape(2), A = cols(in[W0], w);
      std::vector<float> a((size_t)L * A);
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
      std::vector<float> a((size_t)L * A);
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

static std::invalid_argument refused(const char* what, const char* why) {
  return std::invalid_argument(std::string("[macspec block] ") + what + why);
}

static Mats layout(int bits, int group_size, bool int8) {
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
  return w.bits == 4 && w.group == 64 && w.int8 && q4_packs() && packed_shapes(m[0], m[1]);
}

// A matrix of N (any where N < 0) rows and K columns, as `w` stores it; returns its rows.
static int check_matrix(const std::vector<mx::array>& m, const Mats& w, int N, int K,
                        const char* what) {
  if (m.size() != (size_t)w.arrays()) {
    throw refused(what, w.bits == 32 ? ": one array" : ": weights, scales and biases");
  }
  const mx::array& a = m[0];
  if (w.bits == 32) {
    check_float32(a, what);
  } else if (a.dtype() != mx::uint32 || m[1].ndim() != a.ndim() || m[2].shape() != m[1].shape() ||
             m[2].dtype() != m[1].dtype() ||
             !(m[1].dtype() == mx::float32 || m[1].dtype() == mx::float16 ||
               m[1].dtype() == mx::bfloat16)) {
    throw refused(what, ": uint32 weights, and scales and biases of one type and shape");
  }
  if (!(a.ndim() == 2 || packed_layout(m, w)) || (N >= 0 && matrix_rows(a) != N) ||
      cols(a, w) != K ||
      (w.bits != 32 && a.ndim() == 2 &&
       (K % w.group || m[1].shape(0) != a.shape(0) || m[1].shape(1) != K / w.group))) {
    throw refused(what, " of the wrong shape");
  }
  return matrix_rows(a);
}

static void append(std::vector<mx::array>& inputs, const std::vector<mx::array>& m) {
  inputs.insert(inputs.end(), m.begin(), m.end());
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
    bool int8) {
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
  return mx::array::make_arrays(
      {{1, heads, L, d}, {1, kv_heads, L, d}, {1, kv_heads, L, d}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<QkvRope>(cpu_stream(), w, eps, heads, kv_heads, offset, traditional,
                                biases.has_value(), positions.has_value()),
      inputs);
}

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
  for (auto* a : {&h, &q, &k, &v, &norm}) {
    check_float32(*a, "h, q, k, v and norm weight");
  }
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
    check_float32(k, "k");
    check_float32(v, "v");
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
      nb::arg("int8") = false);
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
