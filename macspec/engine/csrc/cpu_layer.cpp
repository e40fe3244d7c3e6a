// The rest of a decoder layer on MLX's CPU backend, one primitive each: RMS norm, SwiGLU, RoPE
// with the split into heads, and attention of a few rows over the KV cache. MLX runs each of
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
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;

namespace macspec {

typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline f8 load8(const float* p) {
  return *(const f8u*)p;
}

static inline void store8(float* p, f8 v) {
  *(f8u*)p = v;
}

// The lanes of v summed, pairwise (lane i + lane i + 4, then + 2, + 1).
static inline float hsum8(f8 v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

static inline float dot(const float* a, const float* b, int n) {
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

// exp(x) as MLX computes it on the CPU (2^n * 2^f, Cephes' polynomial for 2^f), 8 lanes at once.
static inline f8 exp8(f8 x) {
  const f8 lo = f8{} - 127.0f, hi = f8{} + 127.0f;
  f8 t = x * 1.4426950408889634f;
  t = t < lo ? lo : (t > hi ? hi : t);
  f8 n = (f8)_mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  f8 f = t - n;
  f8 p = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  f8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return t > lo ? p * scale : f8{};
}

static void check_float32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("[macspec] float32 ") + what);
  }
}

// Registers the primitive's arrays with MLX's CPU stream and allocates its outputs.
static mx::cpu::CommandEncoder& start(
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

class LayerOp : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[macspec layer ops] CPU only");
  }
};

// ---------------------------------------------------------------- RMS norm

// y = (x * rsqrt(mean(x^2) + eps)) * w over the last axis, as mx.fast.rms_norm.
class RmsNorm : public LayerOp {
 public:
  RmsNorm(mx::Stream s, float eps) : LayerOp(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([x = inputs[0], weight = inputs[1], y = outputs[0].data<float>(),
                      eps = eps_]() {
      std::vector<float> scratch, ws;
      const float* xr = rows_of(x, scratch);
      const float* w = rows_of(weight, ws);
      const int D = x.shape(-1);
      const int rows = D ? x.size() / D : 0;
      for (int m = 0; m < rows; m++) {
        const float* xm = xr + (size_t)m * D;
        float* ym = y + (size_t)m * D;
        const float r = 1.0f / std::sqrt(dot(xm, xm, D) / D + eps);
        for (int d = 0; d < D; d++) {
          ym[d] = (xm[d] * r) * w[d];
        }
      }
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

// silu(gate) * up = gate * up / (1 + exp(-gate)), with MLX's exp.
class Swiglu : public LayerOp {
 public:
  using LayerOp::LayerOp;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    encoder.dispatch([g = inputs[0], u = inputs[1], y = outputs[0].data<float>()]() {
      std::vector<float> gs, us;
      const float* gp = rows_of(g, gs);
      const float* up = rows_of(u, us);
      const size_t n = g.size();
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
      const float* q = rows_of(in[0], s0);
      const float* k = rows_of(in[1], s1);
      const float* v = rows_of(in[2], s2);
      const float* cos = rows_of(in[3], s3);
      const float* sin = rows_of(in[4], s4);
      const int32_t* positions = has_positions ? in[5].data<int32_t>() : nullptr;
      const int half = in[3].shape(1), dims = 2 * half;
      const int L = in[0].shape(1), D = in[0].shape(2) / H;
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

// ---------------------------------------------------------------- attention

// x (1, heads, T, D) read where it lies when each row of D is contiguous (a KV cache's view),
// else copied; `head` and `row` get the strides between heads and between rows.
static const float* in_place(const mx::array& x, std::vector<float>& scratch, size_t& head,
                             size_t& row) {
  if (x.strides()[3] == 1 || x.shape(3) == 1) {
    head = x.strides()[1];
    row = x.strides()[2];
    return x.data<float>();
  }
  head = (size_t)x.shape(2) * x.shape(3);
  row = x.shape(3);
  return rows_of(x, scratch);
}

// softmax(q k^T * scale) v for L query rows over T keys (the last L of them the rows' own),
// grouped kv heads, as (1, L, H*D) ready for the output projection. A row sees the keys up to
// its own (causal), or those its row of `mask` (L, T, bool) allows (a token tree).
class Attend : public LayerOp {
 public:
  Attend(mx::Stream s, float scale, bool causal) : LayerOp(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    const bool has_mask = inputs.size() > 3;
    encoder.dispatch([in = inputs, y = outputs[0].data<float>(), scale = scale_,
                      causal = causal_, has_mask]() {
      const mx::array &q = in[0], &k = in[1], &v = in[2];
      const int H = q.shape(1), L = q.shape(2), D = q.shape(3);
      const int KVH = k.shape(1), T = k.shape(2), rep = H / KVH;
      std::vector<float> qs, ks, vs;
      const float* qp = rows_of(q, qs);
      // The cache's keys and values are read in place (a view of its buffer, rows of D in
      // order); any other layout is copied first.
      size_t kh, kt, vh, vt;
      const float* kp = in_place(k, ks, kh, kt);
      const float* vp = in_place(v, vs, vh, vt);
      const bool* mask = has_mask ? in[3].data<bool>() : nullptr;
      std::vector<float> scores((size_t)H * L * T);
      auto one = [&](int task) {  // head h of row i
        const int h = task / L, i = task % L;
        const float* qi = qp + ((size_t)h * L + i) * D;
        const float* kb = kp + (size_t)(h / rep) * kh;
        const float* vb = vp + (size_t)(h / rep) * vh;
        const bool* mi = mask ? mask + (size_t)i * T : nullptr;
        const int seen = causal ? T - L + i + 1 : T;
        float* s = scores.data() + (size_t)task * T;
        float top = -INFINITY;
        for (int t = 0; t < seen; t++) {
          if (mi && !mi[t]) {
            continue;
          }
          s[t] = dot(qi, kb + t * kt, D) * scale;
          top = std::max(top, s[t]);
        }
        float* yo = y + ((size_t)i * H + h) * D;
        std::fill(yo, yo + D, 0.0f);
        float total = 0.0f;
        for (int t = 0; t < seen; t++) {
          if (mi && !mi[t]) {
            continue;
          }
          const float p = std::exp(s[t] - top);
          total += p;
          const float* vr = vb + t * vt;
          for (int d = 0; d < D; d++) {
            yo[d] += p * vr[d];
          }
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int d = 0; d < D; d++) {
          yo[d] *= inv;
        }
      };
      // Threads only where the work outweighs waking them (long contexts, many rows).
      if ((size_t)H * L * T * D >= (1u << 18)) {
        Pool::get().run(H * L, one);
      } else {
        for (int task = 0; task < H * L; task++) {
          one(task);
        }
      }
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& q = inputs[0];
    return {{1, q.shape(2), q.shape(1) * q.shape(3)}};
  }
  const char* name() const override {
    return "MacspecAttend";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attend&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

mx::array attend(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    std::optional<mx::array> mask) {
  for (auto* a : {&q, &k, &v}) {
    check_float32(*a, "q, k and v");
  }
  if (q.ndim() != 4 || k.ndim() != 4 || q.shape(0) != 1 || k.shape() != v.shape() ||
      k.shape(0) != 1 || q.shape(3) != k.shape(3) || k.shape(1) <= 0 ||
      q.shape(1) % k.shape(1) || k.shape(2) < q.shape(2)) {
    throw std::invalid_argument("[macspec attend] q (1, H, L, D) and k, v (1, KVH, T >= L, D)");
  }
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->size() != (size_t)q.shape(2) * k.shape(2)) {
      throw std::invalid_argument("[macspec attend] a boolean mask of shape (L, T)");
    }
    inputs.push_back(mx::contiguous(mx::reshape(*mask, {q.shape(2), k.shape(2)})));
  }
  return mx::array::make_arrays(
      {{1, q.shape(2), q.shape(1) * q.shape(3)}},
      {mx::float32},
      std::make_shared<Attend>(cpu_stream(), scale, causal),
      inputs)[0];
}

void bind_layer(nb::module_& m) {
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"));
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
  m.def(
      "attend",
      &attend,
      nb::arg("q"),
      nb::arg("k"),
      nb::arg("v"),
      nb::arg("scale"),
      nb::arg("causal"),
      nb::arg("mask") = nb::none());
}

}  // namespace macspec
