// Attention of a few query rows over the KV cache, one primitive: on MLX's CPU backend it is a
// graph of generic ops otherwise, most of its time dispatch at a short context (docs/cpu.md).
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

#include "kv.h"
#include "layer.h"
#include "attend_keys.h"

namespace nb = nanobind;

namespace macspec {

// Keys per piece of attention work. Pieces start at fixed positions (0, KEYS, 2 KEYS, ...),
// so how a row's keys are split, and so its sums, never depend on the pass's other rows.
constexpr int KEYS = 256;

void attend_rows(const mx::array& q, const mx::array& k, const mx::array& v, const bool* mask,
                 float scale, bool causal, float* y) {
  std::vector<float> qs;
  const int L = q.shape(2);
  attend_query_rows(rows_of(q, qs), q.shape(1), L, 0, L, q.shape(3), k, v, k.shape(2), mask,
                    scale, causal, y);
}

// softmax(q k^T * scale) v for L query rows over T keys (the last L of them the rows' own),
// grouped kv heads, into y as (L, H*D) ready for the output projection. A row sees the keys up
// to its own (causal), or those its row of `mask` (L, T) allows (a token tree).
//
// The work is split by kv head, piece of KEYS keys and block of rows: a task reads its piece's
// keys and values from memory once for all its rows and the query heads that share them (the
// other rows then find them in the core's caches: a long context is not read again per row).
// Per row and query head it keeps its largest score, the sum of e^(score - largest) and the
// values weighed by them. The pieces of a row are then joined in order (the usual rescaling by
// e^(largest of piece - largest of all)), on one thread.
void attend_query_rows(const float* qp, int H, int Lq, int q0, int L, int D, const mx::array& k,
                       const mx::array& v, int T, const bool* mask, float scale, bool causal,
                       float* y) {
  const int KVH = k.shape(1), rep = H / KVH;
  std::vector<float> ks, vs;
  std::vector<uint16_t> kh16, vh16;
  // The cache's keys and values are read in place (a view of its buffer, rows of D in
  // order); any other layout is copied first.
  const KV kk = in_place(k, ks, kh16), vv = in_place(v, vs, vh16);
  const int pieces = (T + KEYS - 1) / KEYS;
  const size_t stride = (size_t)D + 2;  // per query head: largest, sum, weighed values
  // (every task writes all of its entries: no clearing)
  const Room<ATTENTION_PIECES> part((size_t)KVH * L * pieces * rep * stride);
  // Rows split into blocks only as far as needed to give each thread a few tasks.
  const int spread = KVH * pieces, blocks = std::min(L, std::max(1, (8 + spread - 1) / spread));
  const int per_block = (L + blocks - 1) / blocks;
  auto piece = [&](int task) {
    const int c = task % pieces, b = (task / pieces) % blocks, g = task / (pieces * blocks);
    const int t0 = c * KEYS;
    // A float16 cache's piece is widened once for all the task's rows and query heads: the
    // half-sized read is what decoding at a long context waits for, the widening is not.
    thread_local std::vector<float> wk, wv;
    const int m = std::min(T, t0 + KEYS) - t0;  // the piece's keys any row may see
    const size_t ka = (size_t)g * kk.head + (size_t)t0 * kk.row;
    const size_t va = (size_t)g * vv.head + (size_t)t0 * vv.row;
    const float* kb = kk.h ? widen(kk, ka, m, D, wk) : kk.f + ka;
    const float* vb = vv.h ? widen(vv, va, m, D, wv) : vv.f + va;
    const size_t kt = kk.h ? D : kk.row, vt = vv.h ? D : vv.row;
    thread_local std::vector<float> scores;
    const float by = scale;  // a copy the compiler keeps in a register (stores to scores may alias)
    for (int i = b * per_block; i < std::min(L, (b + 1) * per_block); i++) {
      const int seen = causal ? T - L + i + 1 : T;
      const int n = std::max(0, std::min(seen, t0 + KEYS) - t0);
      const bool* mi = mask ? mask + (size_t)i * T + t0 : nullptr;
      float* out = part.data() + (((size_t)g * L + i) * pieces + c) * rep * stride;
      const int padded = (n + 7) / 8 * 8;
      scores.assign((size_t)rep * padded, -INFINITY);  // the padding: e^-inf = 0
      thread_local std::vector<const float*> qs;  // each query head's row, and where its
      thread_local std::vector<float*> ss, accs;   // scores and weighed values go
      qs.resize(rep), ss.resize(rep), accs.resize(rep);
      for (int j = 0; j < rep; j++) {
        qs[j] = qp + ((size_t)(g * rep + j) * Lq + q0 + i) * D;
        ss[j] = scores.data() + (size_t)j * padded;
        accs[j] = out + j * stride + 2;
      }
      for (int s0 = 0; s0 < n; s0 += SUB) {  // every head's scores, a sub-block of keys at a time
        const int s1 = std::min(n, s0 + SUB);
        for (int j = 0; j < rep;) {
          j += score_heads(rep - j, qs.data() + j, kb, kt, s0, s1, D, ss.data() + j);
        }
      }
      for (int j = 0; j < rep; j++) {
        float* sj = ss[j];
        float top = -INFINITY;
        if (mi) {  // a tree's rows: the keys the mask hides score -inf
          for (int t = 0; t < n; t++) {
            sj[t] = mi[t] ? sj[t] * by : -INFINITY;
            top = std::max(top, sj[t]);
          }
        } else {  // 8 at a time (the padding is -inf): the same products, the same largest
          f8 tops = f8{} - INFINITY;
          for (int t = 0; t < padded; t += 8) {
            const f8 x = load8(sj + t) * by;
            store8(sj + t, x);
            tops = tops > x ? tops : x;
          }
          std::fill(sj + n, sj + padded, -INFINITY);  // still -inf, whatever the scale's sign
          for (int l = 0; l < 8; l++) {
            top = std::max(top, tops[l]);
          }
        }
        out[j * stride] = top;
        std::fill(accs[j], accs[j] + D, 0.0f);
        if (top == -INFINITY) {  // no key to see in this piece
          out[j * stride + 1] = 0.0f;
          std::fill(sj, sj + padded, 0.0f);
          continue;
        }
        f8 total{};
        int t = 0;
#if defined(__AVX512F__)
        for (; t + 16 <= padded; t += 16) {  // total's 8 lanes summed in the same order
          const f8x2 p = exp8x2(*(const f8x2u*)(sj + t) - top);
          *(f8x2u*)(sj + t) = p;
          total += (f8)__builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7);
          total += (f8)__builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15);
        }
#endif
        for (; t < padded; t += 8) {
          const f8 p = exp8(load8(sj + t) - top);
          store8(sj + t, p);
          total += p;
        }
        out[j * stride + 1] = hsum8(total);
      }
      for (int s0 = 0; s0 < n; s0 += SUB) {  // the values, weighed in key order
        const int s1 = std::min(n, s0 + SUB);
        for (int j = 0; j < rep; j += HEADS) {
          by_heads(rep - j, [&]<int G>() {
            weigh_keys<G, VECS>(ss.data() + j, vb, vt, s0, s1, D, accs.data() + j);
          });
        }
      }
    }
  };
  const int tasks = KVH * pieces * blocks;
  // Threads only where the work outweighs waking them (long contexts, many rows).
  if ((size_t)H * L * T * D >= (1u << 16)) {
    Pool::get().run(tasks, piece);
  } else {
    for (int task = 0; task < tasks; task++) {
      piece(task);
    }
  }
  for (int i = 0; i < L; i++) {
    for (int h = 0; h < H; h++) {
      const int g = h / rep, j = h % rep;
      const float* first = part.data() + (((size_t)g * L + i) * pieces * rep + j) * stride;
      const size_t next = rep * stride;  // the same query head in the next piece
      float top = -INFINITY, total = 0.0f;
      for (int c = 0; c < pieces; c++) {
        top = std::max(top, first[c * next]);
      }
      float* yo = y + ((size_t)i * H + h) * D;
      std::fill(yo, yo + D, 0.0f);
      for (int c = 0; c < pieces && top > -INFINITY; c++) {
        const float* pc = first + c * next;
        if (pc[0] == -INFINITY) {
          continue;
        }
        const float w = std::exp(pc[0] - top);
        total += w * pc[1];
        for (int d = 0; d < D; d++) {
          yo[d] += w * pc[2 + d];
        }
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int d = 0; d < D; d++) {
        yo[d] *= inv;
      }
    }
  }
}

// attend_rows as one primitive: (q (1, H, L, D), k, v (1, KVH, T, D)[, mask]) -> (1, L, H*D).
class Attend : public LayerOp {
 public:
  Attend(mx::Stream s, float scale, bool causal) : LayerOp(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = start(stream(), inputs, outputs);
    const bool has_mask = inputs.size() > 3;
    encoder.dispatch([in = inputs, y = outputs[0].data<float>(), scale = scale_,
                      causal = causal_, has_mask]() {
      attend_rows(in[0], in[1], in[2], has_mask ? in[3].data<bool>() : nullptr, scale, causal, y);
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
  check_float32(q, "q");
  check_kv(k, "k");
  check_kv(v, "v");
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

void bind_attention(nb::module_& m) {
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
