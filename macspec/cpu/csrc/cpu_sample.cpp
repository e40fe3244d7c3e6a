// Sampling over a whole vocabulary on MLX's CPU backend, one primitive each: softmax(x / T), the
// argmax and the inverse-CDF draw of (rows, V) float32 rows. MLX's CPU ops run these on one core
// (docs/cpu.md has the figures); here the threads share fixed segments of each row,
// and every sum adds the segments' partial sums in order, so a row's result is the same whatever
// the number of rows and threads.

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cmath>
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

// ---------------------------------------------------------------- softmax over a vocabulary

// softmax(x * scale) over the last axis of float32 rows: a sampling distribution over a whole
// vocabulary (152k ids), which MLX's CPU ops compute on one core. Each row is
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

void bind_sample(nb::module_& m) {
  m.def("softmax", &softmax, nb::arg("x"), nb::arg("scale") = 1.0f);
  m.def("argmax", &argmax, nb::arg("x"));
  m.def("sample", &sample, nb::arg("probs"), nb::arg("u"));
}

}  // namespace macspec
