// The rest of a decoder layer on MLX's CPU backend, one primitive each: RMS norm, SwiGLU, RoPE
// with the split into heads (attention: cpu_attention.cpp). MLX runs each of
// these on the CPU as a graph of generic ops, most of their time dispatch (thousands of ops a
// pass); one primitive costs a few microseconds plus its arithmetic (docs/cpu.md).
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
#include "kv.h"
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
// With `half`, k and v come out as float16 (a KV cache kept so: switches.KV_CACHE), rounded as
// astype(float16) would round the float32 ones, without two more ops a layer.
class RopeHeads : public LayerOp {
 public:
  RopeHeads(mx::Stream s, int heads, int kv_heads, int offset, bool traditional, bool half)
      : LayerOp(s), heads_(heads), kv_heads_(kv_heads), offset_(offset), traditional_(traditional),
        half_(half) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    const bool has_positions = inputs.size() > 5;
    encoder.dispatch([in = inputs, qo = outputs[0].data<float>(), kb = outputs[1].data<char>(),
                      vb = outputs[2].data<char>(), H = heads_, KVH = kv_heads_, offset = offset_,
                      traditional = traditional_, half = half_, has_positions]() {
      std::vector<float> s0, s1, s2, s3, s4;
      const int L = in[0].shape(1), D = in[0].shape(2) / H;
      NewKV kv(kb, vb, (size_t)KVH * L * D, half);
      rope_rows(rows_of(in[0], s0), rows_of(in[1], s1), rows_of(in[2], s2), rows_of(in[3], s3),
                rows_of(in[4], s4), in[3].shape(1), has_positions ? in[5].data<int32_t>() : nullptr,
                offset, L, H, KVH, D, traditional, qo, kv.k, kv.v);
      kv.store();
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
        traditional_ == o.traditional_ && half_ == o.half_;
  }

 private:
  int heads_, kv_heads_, offset_;
  bool traditional_, half_;
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
    std::optional<mx::array> positions,
    bool half) {
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
  const mx::Dtype kv = half ? mx::float16 : mx::float32;
  return mx::array::make_arrays(
      {{1, heads, L, D}, {1, kv_heads, L, D}, {1, kv_heads, L, D}},
      {mx::float32, kv, kv},
      std::make_shared<RopeHeads>(cpu_stream(), heads, kv_heads, offset, traditional, half),
      inputs);
}

void bind_attention(nb::module_& m);  // cpu_attention.cpp

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
      nb::arg("positions") = nb::none(),
      nb::arg("half") = false);
  bind_attention(m);
}

}  // namespace macspec
