// The rest of a decoder layer on MLX's CPU backend, one primitive each: RMS norm, SwiGLU, RoPE
// with the split into heads (attention: cpu_attention.cpp). MLX runs each of
// these on the CPU as a graph of generic ops, 10-200 us apiece here, most of it dispatch (about
// 2,000 ops a SmolLM2 pass); one primitive costs about 3 us plus its arithmetic.
//
// Every row (and every head of a row) is computed alone, in the same order whatever the number
// of rows and threads, so a plain step and a verification row agree bit for bit.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "layer.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;

namespace macspec {

// ---------------------------------------------------------------- RMS norm

void norm_rows(const float* x, const float* w, float* y, int rows, int D, float eps) {
  for (int m = 0; m < rows; m++) {
    const float* xm = x + (size_t)m * D;
    float* ym = y + (size_t)m * D;
    const float r = 1.0f / std::sqrt(dot(xm, xm, D) / D + eps);
    for (int d = 0; d < D; d++) {
      ym[d] = (xm[d] * r) * w[d];
    }
  }
}

// y = (x * rsqrt(mean(x^2) + eps)) * w over the last axis, as mx.fast.rms_norm.
class RmsNorm : public LayerOp {
 public:
  RmsNorm(mx::Stream s, float eps) : LayerOp(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([x = inputs[0], weight = inputs[1], y = outputs[0].data<float>(),
                      eps = eps_]() {
      std::vector<float> scratch, ws;
      const int D = x.shape(-1);
      norm_rows(rows_of(x, scratch), rows_of(weight, ws), y, D ? x.size() / D : 0, D, eps);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override {
    return "MacspecRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  check_float32(x, "x");
  check_float32(w, "weight");
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("[macspec rms_norm] weight of shape (D,) for x (..., D)");
  }
  return mx::array::make_arrays(
      {x.shape()}, {mx::float32}, std::make_shared<RmsNorm>(cpu_stream(), eps), {x, w})[0];
}

// ---------------------------------------------------------------- SwiGLU

void swiglu_n(const float* gp, const float* up, float* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f8 gv = load8(gp + i);
    store8(y + i, gv * load8(up + i) / (1.0f + exp8(-gv)));
  }
  if (i < n) {  // the tail through a padded vector: the same arithmetic as the rest
    float gt[8] = {}, ut[8] = {}, yt[8];
    std::memcpy(gt, gp + i, (n - i) * 4);
    std::memcpy(ut, up + i, (n - i) * 4);
    f8 gv = load8(gt);
    store8(yt, gv * load8(ut) / (1.0f + exp8(-gv)));
    std::memcpy(y + i, yt, (n - i) * 4);
  }
}

// silu(gate) * up = gate * up / (1 + exp(-gate)), with MLX's exp.
class Swiglu : public LayerOp {
 public:
  using LayerOp::LayerOp;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([g = inputs[0], u = inputs[1], y = outputs[0].data<float>()]() {
      std::vector<float> gs, us;
      swiglu_n(rows_of(g, gs), rows_of(u, us), y, g.size());
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override {
    return "MacspecSwiglu";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  check_float32(gate, "gate");
  check_float32(up, "up");
  if (gate.shape() != up.shape()) {
    throw std::invalid_argument("[macspec swiglu] gate and up of one shape");
  }
  return mx::array::make_arrays(
      {gate.shape()}, {mx::float32}, std::make_shared<Swiglu>(cpu_stream()), {gate, up})[0];
}

// ---------------------------------------------------------------- RoPE and the heads

void rope_rows(const float* q, const float* k, const float* v, const float* cos, const float* sin,
               int half, const int32_t* positions, int offset, int L, int H, int KVH, int D,
               bool traditional, float* qo, float* ko, float* vo) {
  const int dims = 2 * half;
  auto rotate = [&](const float* src, float* dst, int pos) {
    const float* c = cos + (size_t)pos * half;
    const float* s = sin + (size_t)pos * half;
    for (int j = 0; j < half; j++) {
      const int a = traditional ? 2 * j : j, b = traditional ? 2 * j + 1 : j + half;
      const float x1 = src[a], x2 = src[b];
      dst[a] = x1 * c[j] - x2 * s[j];
      dst[b] = x1 * s[j] + x2 * c[j];
    }
    std::memcpy(dst + dims, src + dims, sizeof(float) * (D - dims));
  };
  for (int i = 0; i < L; i++) {
    const int pos = positions ? positions[i] : offset + i;
    for (int h = 0; h < H; h++) {
      rotate(q + ((size_t)i * H + h) * D, qo + ((size_t)h * L + i) * D, pos);
    }
    for (int h = 0; h < KVH; h++) {
      rotate(k + ((size_t)i * KVH + h) * D, ko + ((size_t)h * L + i) * D, pos);
      std::memcpy(vo + ((size_t)h * L + i) * D, v + ((size_t)i * KVH + h) * D, sizeof(float) * D);
    }
  }
}

// q (1, L, H*D), k and v (1, L, KVH*D), as the projections give them, to q and k rotated by
// their positions and all three as (1, heads, L, D). Row i sits at position offset + i, or at
// positions[i] when given (a token tree's rows, by depth). cos/sin: (positions, dims / 2).
class RopeHeads : public LayerOp {
 public:
  RopeHeads(mx::Stream s, int heads, int kv_heads, int offset, bool traditional)
      : LayerOp(s), heads_(heads), kv_heads_(kv_heads), offset_(offset), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    const bool has_positions = inputs.size() > 5;
    encoder.dispatch([in = inputs, qo = outputs[0].data<float>(), ko = outputs[1].data<float>(),
                      vo = outputs[2].data<float>(), H = heads_, KVH = kv_heads_,
                      offset = offset_, traditional = traditional_, has_positions]() {
      std::vector<float> s0, s1, s2, s3, s4;
      const int L = in[0].shape(1), D = in[0].shape(2) / H;
      rope_rows(rows_of(in[0], s0), rows_of(in[1], s1), rows_of(in[2], s2), rows_of(in[3], s3),
                rows_of(in[4], s4), in[3].shape(1), has_positions ? in[5].data<int32_t>() : nullptr,
                offset, L, H, KVH, D, traditional, qo, ko, vo);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int L = inputs[0].shape(1), D = inputs[0].shape(2) / heads_;
    return {{1, heads_, L, D}, {1, kv_heads_, L, D}, {1, kv_heads_, L, D}};
  }
  const char* name() const override {
    return "MacspecRopeHeads";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RopeHeads&>(other);
    return heads_ == o.heads_ && kv_heads_ == o.kv_heads_ && offset_ == o.offset_ &&
        traditional_ == o.traditional_;
  }

 private:
  int heads_, kv_heads_, offset_;
  bool traditional_;
};

std::vector<mx::array> rope_heads(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& cos,
    const mx::array& sin,
    int heads,
    int kv_heads,
    int offset,
    bool traditional,
    std::optional<mx::array> positions) {
  for (auto* a : {&q, &k, &v, &cos, &sin}) {
    check_float32(*a, "q, k, v and tables");
  }
  const int L = q.ndim() == 3 ? q.shape(1) : -1;
  if (q.ndim() != 3 || q.shape(0) != 1 || heads <= 0 || kv_heads <= 0 || q.shape(2) % heads ||
      k.shape() != v.shape() || k.ndim() != 3 || k.shape(1) != L ||
      k.shape(2) * heads != q.shape(2) * kv_heads) {
    throw std::invalid_argument("[macspec rope_heads] q (1, L, H*D), k and v (1, L, KVH*D)");
  }
  const int D = q.shape(2) / heads;
  if (cos.ndim() != 2 || cos.shape() != sin.shape() || 2 * cos.shape(1) > D) {
    throw std::invalid_argument("[macspec rope_heads] cos/sin tables (positions, dims / 2)");
  }
  std::vector<mx::array> inputs = {q, k, v, cos, sin};
  if (positions) {
    if (positions->dtype() != mx::int32 || positions->size() != (size_t)L) {
      throw std::invalid_argument("[macspec rope_heads] int32 positions, one per row");
    }
    inputs.push_back(mx::contiguous(*positions));
  } else if (offset < 0 || offset + L > cos.shape(0)) {
    throw std::invalid_argument("[macspec rope_heads] positions past the table");
  }
  return mx::array::make_arrays(
      {{1, heads, L, D}, {1, kv_heads, L, D}, {1, kv_heads, L, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<RopeHeads>(cpu_stream(), heads, kv_heads, offset, traditional),
      inputs);
}

// ---------------------------------------------------------------- softmax over a vocabulary

// softmax(x * scale) over the last axis of float32 rows: a sampling distribution over a whole
// vocabulary (152k ids), which MLX's CPU ops compute on one core in about 1 ms a row. Each row is
// cut into fixed segments that the threads share; the sum adds the segments' partial sums in
// order, so a row's result is the same whatever the number of rows and threads.
constexpr size_t SOFTMAX_SEGMENT = 8192;

class Softmax : public LayerOp {
 public:
  Softmax(mx::Stream s, float scale) : LayerOp(s), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([x = inputs[0], y = outputs[0].data<float>(), scale = scale_]() {
      std::vector<float> xs;
      const size_t V = x.shape(-1), rows = V ? x.size() / V : 0;
      softmax_rows(rows_of(x, xs), y, rows, V, scale);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override {
    return "MacspecSoftmax";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const Softmax&>(other).scale_;
  }

 private:
  static void softmax_rows(const float* x, float* y, size_t rows, size_t V, float scale) {
    const size_t segs = (V + SOFTMAX_SEGMENT - 1) / SOFTMAX_SEGMENT, chunks = rows * segs;
    if (chunks == 0) {
      return;
    }
    std::vector<float> top(chunks), sum(chunks);
    auto span = [&](size_t c, size_t& at, size_t& n) {
      at = (c / segs) * V + (c % segs) * SOFTMAX_SEGMENT;
      n = std::min(SOFTMAX_SEGMENT, V - (c % segs) * SOFTMAX_SEGMENT);
    };
    Pool::get().run((int)chunks, [&](int c) {
      size_t at, n;
      span(c, at, n);
      f8 mv = f8{} - INFINITY;
      size_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const f8 v = load8(x + at + i);
        mv = mv > v ? mv : v;
      }
      float m = -INFINITY;
      for (int l = 0; l < 8; l++) {
        m = std::max(m, mv[l]);
      }
      for (; i < n; i++) {
        m = std::max(m, x[at + i]);
      }
      top[c] = m;
    });
    for (size_t r = 0; r < rows; r++) {  // the row's max, into each of its segments
      const float m = *std::max_element(&top[r * segs], &top[r * segs] + segs);
      std::fill(&top[r * segs], &top[r * segs] + segs, m);
    }
    Pool::get().run((int)chunks, [&](int c) {
      size_t at, n;
      span(c, at, n);
      const f8 m = f8{} + top[c], k = f8{} + scale;
      f8 acc{};
      size_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const f8 e = exp8((load8(x + at + i) - m) * k);
        store8(y + at + i, e);
        acc += e;
      }
      float s = hsum8(acc);
      for (; i < n; i++) {  // the tail through a padded vector: the same exp as the rest
        f8 t = f8{} - INFINITY;
        t[0] = x[at + i];
        const float e = exp8((t - m) * k)[0];
        y[at + i] = e;
        s += e;
      }
      sum[c] = s;
    });
    Pool::get().run((int)chunks, [&](int c) {
      size_t at, n;
      span(c, at, n);
      const size_t r = c / segs;
      float total = 0.0f;
      for (size_t j = 0; j < segs; j++) {
        total += sum[r * segs + j];
      }
      const f8 t = f8{} + total;
      size_t i = 0;
      for (; i + 8 <= n; i += 8) {
        store8(y + at + i, load8(y + at + i) / t);
      }
      for (; i < n; i++) {
        y[at + i] /= total;
      }
    });
  }

  float scale_;
};

mx::array softmax(const mx::array& x, float scale) {
  check_float32(x, "x");
  if (x.ndim() < 1) {
    throw std::invalid_argument("[macspec softmax] rows of at least one axis");
  }
  return mx::array::make_arrays(
      {x.shape()}, {mx::float32}, std::make_shared<Softmax>(cpu_stream(), scale), {x})[0];
}

// ---------------------------------------------------------------- argmax and sampling of rows

// The segments of rows x V that the threads share (softmax's): chunk c is row c / segs.
struct Segments {
  size_t V, segs;
  Segments(size_t V) : V(V), segs((V + SOFTMAX_SEGMENT - 1) / SOFTMAX_SEGMENT) {}
  size_t at(size_t c) const {
    return (c / segs) * V + (c % segs) * SOFTMAX_SEGMENT;
  }
  size_t size(size_t c) const {
    return std::min(SOFTMAX_SEGMENT, V - (c % segs) * SOFTMAX_SEGMENT);
  }
};

// The first id of each row's largest value (mx.argmax's; NaNs are never the largest).
std::vector<uint32_t> argmax_rows(const float* x, size_t rows, size_t V) {
  const Segments sg(V);
  const size_t chunks = rows * sg.segs;
  std::vector<float> top(chunks, -INFINITY);
  std::vector<uint32_t> where(chunks, 0), out(rows, 0);
  Pool::get().run((int)chunks, [&](int c) {
    const float* p = x + sg.at(c);
    const size_t n = sg.size(c);
    f8 mv = f8{} - INFINITY;  // the largest value, 8 lanes at a time; then its first id
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const f8 v = load8(p + i);
      mv = v > mv ? v : mv;
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) {
      m = std::max(m, mv[l]);
    }
    for (; i < n; i++) {
      m = p[i] > m ? p[i] : m;
    }
    size_t best = 0;
    while (best < n && !(p[best] == m)) {
      best++;
    }
    best = best < n ? best : 0;  // every value NaN (or -inf alone): the first
    top[c] = m;
    where[c] = (uint32_t)((c % sg.segs) * SOFTMAX_SEGMENT + best);
  });
  for (size_t r = 0; r < rows; r++) {
    float m = -INFINITY;
    for (size_t j = 0; j < sg.segs; j++) {
      if (top[r * sg.segs + j] > m) {
        m = top[r * sg.segs + j];
        out[r] = where[r * sg.segs + j];
      }
    }
  }
  return out;
}

// Inverse-CDF sampling: per row, the first id whose running sum of probabilities exceeds u * the
// row's total (never an id of probability 0), else the last id with any. The running sum adds the
// segments' sums in order and then each id of the segment it lands in, one by one: the same
// arithmetic whatever the number of rows and threads.
std::vector<uint32_t> sample_rows(const float* p, const float* u, size_t rows, size_t V) {
  const Segments sg(V);
  const size_t chunks = rows * sg.segs;
  std::vector<float> sum(chunks);
  Pool::get().run((int)chunks, [&](int c) {
    const float* s = p + sg.at(c);
    float t = 0.0f;
    for (size_t i = 0; i < sg.size(c); i++) {
      t += s[i];
    }
    sum[c] = t;
  });
  std::vector<uint32_t> out(rows, 0);
  for (size_t r = 0; r < rows; r++) {
    const float* sr = &sum[r * sg.segs];
    float total = 0.0f;
    for (size_t j = 0; j < sg.segs; j++) {
      total += sr[j];
    }
    const float goal = u[r] * total;
    float run = 0.0f;
    size_t j = 0;
    while (j + 1 < sg.segs && run + sr[j] <= goal) {
      run += sr[j++];
    }
    const float* row = p + r * V;
    size_t last = V, id = V;
    for (size_t i = j * SOFTMAX_SEGMENT; i < V && id == V; i++) {
      run += row[i];
      if (row[i] > 0.0f) {
        last = i;
        if (run > goal) {
          id = i;
        }
      }
    }
    if (id == V) {  // u * total rounded past the sums: the last id with any probability
      for (size_t i = V; i-- > 0 && last == V;) {
        last = row[i] > 0.0f ? i : last;
      }
      id = last == V ? 0 : last;
    }
    out[r] = (uint32_t)id;
  }
  return out;
}

// argmax (rows, V) -> (rows,) and sample (rows, V), (rows,) -> (rows,), as uint32 ids.
class PickIds : public LayerOp {
 public:
  PickIds(mx::Stream s, bool sampling) : LayerOp(s), sampling_(sampling) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([inputs, y = outputs[0].data<uint32_t>(), sampling = sampling_]() {
      std::vector<float> xs, us;
      const size_t V = inputs[0].shape(-1), rows = inputs[0].shape(0);
      const float* x = rows_of(inputs[0], xs);
      const auto ids = sampling ? sample_rows(x, rows_of(inputs[1], us), rows, V)
                                : argmax_rows(x, rows, V);
      std::copy(ids.begin(), ids.end(), y);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }
  const char* name() const override {
    return sampling_ ? "MacspecSample" : "MacspecArgmax";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return sampling_ == static_cast<const PickIds&>(other).sampling_;
  }

 private:
  bool sampling_;
};

mx::array argmax(const mx::array& x) {
  check_float32(x, "x");
  if (x.ndim() != 2 || x.shape(1) == 0) {
    throw std::invalid_argument("[macspec argmax] rows (n, V) of float32");
  }
  return mx::array::make_arrays(
      {{x.shape(0)}}, {mx::uint32}, std::make_shared<PickIds>(cpu_stream(), false), {x})[0];
}

mx::array sample(const mx::array& probs, const mx::array& u) {
  check_float32(probs, "probs");
  check_float32(u, "u");
  if (probs.ndim() != 2 || probs.shape(1) == 0 || u.size() != probs.shape(0)) {
    throw std::invalid_argument("[macspec sample] probs (n, V) and one u per row");
  }
  return mx::array::make_arrays({{probs.shape(0)}}, {mx::uint32},
                                std::make_shared<PickIds>(cpu_stream(), true),
                                {probs, mx::reshape(u, {probs.shape(0)})})[0];
}

void bind_attention(nb::module_& m);  // cpu_attention.cpp

void bind_layer(nb::module_& m) {
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"));
  m.def("softmax", &softmax, nb::arg("x"), nb::arg("scale") = 1.0f);
  m.def("argmax", &argmax, nb::arg("x"));
  m.def("sample", &sample, nb::arg("probs"), nb::arg("u"));
  m.def(
      "rope_heads",
      &rope_heads,
      nb::arg("q"),
      nb::arg("k"),
      nb::arg("v"),
      nb::arg("cos"),
      nb::arg("sin"),
      nb::arg("heads"),
      nb::arg("kv_heads"),
      nb::arg("offset"),
      nb::arg("traditional"),
      nb::arg("positions") = nb::none());
  bind_attention(m);
}

}  // namespace macspec
