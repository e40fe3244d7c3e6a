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

namespace nb = nanobind;

namespace macspec {

// Query heads worked on together, and the 8-float vectors of a value row each keeps in registers:
// a key or value row is read once for the group. 32 vector registers (AVX-512) hold 3 heads x 8
// keys of sums; AVX2's 16 hold fewer. Only the order memory is read in changes with these: every
// score and weighed value is the same sum, in the same order, for any group. With AVX-512 the
// scores of up to 6 heads are summed two heads to a register and the values weighed 16 lanes at
// a time (score_pairs, weigh_wide): the same sums again, at 1.6x the speed (docs/cpu.md).
#if defined(__AVX512VL__)
constexpr int HEADS = 3, VECS = 8;
#else
constexpr int HEADS = 2, VECS = 4;
#endif

// Keys a sub-block: its key (or value) rows stay in the first-level cache while every query head
// of the group reads them. A multiple of 8, so the 8-key tiles below start where they would
// without it, and a key's sum never depends on the sub-blocks.
constexpr int SUB = 64;

// The lanes of 8 vectors summed, lane r of the result = hsum8(a[r]): the same pairwise tree
// (lane i + lane i + 4, then + 2, + 1), with 8 keys' sums moved through it together instead of a
// scalar add per lane and key.
static inline f8 hsum8x8(const f8* a) {
  __m256 h[4];
  for (int r = 0; r < 4; r++) {  // (a[r] + a[r + 4]) lanes i + (i + 4): [a[r] | a[r + 4]]
    const __m256 x = (__m256)a[r], y = (__m256)a[r + 4];
    h[r] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  // + 2: lanes (0, 1) + (2, 3) of each half, two vectors' halves side by side
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(h[0], h[1], 0x44),
                                 _mm256_shuffle_ps(h[0], h[1], 0xEE));
  const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(h[2], h[3], 0x44),
                                 _mm256_shuffle_ps(h[2], h[3], 0xEE));
  // + 1: lanes (0, 2) + (1, 3): [a0 a1 a2 a3 | a4 a5 a6 a7]
  return (f8)_mm256_add_ps(_mm256_shuffle_ps(u, w, 0x88), _mm256_shuffle_ps(u, w, 0xDD));
}

// s[g][t] = dot(q[g], key t) for keys t0 <= t < t1 of G query heads: 8 keys at a time (each
// key's 8 lanes summed over D, then hsum8, then the scalar tail, as dot() sums), the rest alone.
template <int G>
static void score_keys(const float* const* q, const float* kb, size_t kt, int t0, int t1, int D,
                       float* const* s) {
  const int D8 = D - D % 8;
  int t = t0;
  for (; t + 8 <= t1; t += 8) {
    f8 acc[G][8] = {};
    for (int d = 0; d < D8; d += 8) {
      f8 qv[G];
      for (int g = 0; g < G; g++) {
        qv[g] = load8(q[g] + d);
      }
      for (int r = 0; r < 8; r++) {
        const f8 kv = load8(kb + (t + r) * kt + d);
        for (int g = 0; g < G; g++) {
          acc[g][r] += qv[g] * kv;
        }
      }
    }
    for (int g = 0; g < G; g++) {
      f8 sums = hsum8x8(acc[g]);
      for (int r = 0; r < 8 && D8 < D; r++) {
        for (int d = D8; d < D; d++) {
          sums[r] += q[g][d] * kb[(t + r) * kt + d];
        }
      }
      store8(s[g] + t, sums);
    }
  }
  for (; t < t1; t++) {
    for (int g = 0; g < G; g++) {
      s[g][t] = dot(q[g], kb + t * kt, D);
    }
  }
}

#if defined(__AVX512F__)
// [a[0..8) | b[0..8)]
static inline f8x2 load8x2(const float* a, const float* b) {
  const __m256d lo = _mm256_loadu_pd((const double*)a), hi = _mm256_loadu_pd((const double*)b);
  return (f8x2)_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1);
}

// [a[0..8) | a[0..8)]: one load, no shuffle port
static inline f8x2 twice8(const float* a) {
  return (f8x2)_mm512_broadcast_f64x4(_mm256_loadu_pd((const double*)a));
}

// score_keys for 2P query heads in pairs: each register holds two heads' 8 lanes side by side
// against one key's 8 lanes loaded into both halves, so every lane sums the very products
// score_keys<G> sums, in the same order (the same bits), at twice the lanes an instruction.
template <int P>
static void score_pairs(const float* const* q, const float* kb, size_t kt, int t0, int t1, int D,
                        float* const* s) {
  const int D8 = D - D % 8;
  // Each pair's lanes as they are multiplied, laid out once for all the keys
  thread_local std::vector<f8x2> paired;
  paired.resize((size_t)P * (D8 / 8));
  for (int p = 0; p < P; p++) {
    for (int d = 0; d < D8; d += 8) {
      paired[(size_t)p * (D8 / 8) + d / 8] = load8x2(q[2 * p] + d, q[2 * p + 1] + d);
    }
  }
  int t = t0;
  for (; t + 8 <= t1; t += 8) {
    f8x2 acc[P][8];
    for (int p = 0; p < P; p++) {
      for (int r = 0; r < 8; r++) {
        acc[p][r] = f8x2{};
      }
    }
    for (int d = 0; d < D8; d += 8) {
      f8x2 qv[P];
      for (int p = 0; p < P; p++) {
        qv[p] = paired[(size_t)p * (D8 / 8) + d / 8];
      }
      for (int r = 0; r < 8; r++) {
        const f8x2 kv = twice8(kb + (t + r) * kt + d);
        for (int p = 0; p < P; p++) {
          acc[p][r] += qv[p] * kv;
        }
      }
    }
    for (int p = 0; p < P; p++) {
      for (int h = 0; h < 2; h++) {  // head 2p's lanes are the low half, 2p + 1's the high
        f8 half[8];
        for (int r = 0; r < 8; r++) {
          const __m512d a = (__m512d)acc[p][r];
          half[r] = (f8)(h ? _mm512_extractf64x4_pd(a, 1) : _mm512_castpd512_pd256(a));
        }
        const float* qg = q[2 * p + h];
        f8 sums = hsum8x8(half);
        for (int r = 0; r < 8 && D8 < D; r++) {
          for (int d = D8; d < D; d++) {
            sums[r] += qg[d] * kb[(t + r) * kt + d];
          }
        }
        store8(s[2 * p + h] + t, sums);
      }
    }
  }
  for (; t < t1; t++) {
    for (int g = 0; g < 2 * P; g++) {
      s[g][t] = dot(q[g], kb + t * kt, D);
    }
  }
}

// Lanes d0 <= d < d0 + 16 V of acc[g] += p[g][t] * value t, t in order: each lane's sum is
// weigh_keys's own (lanes are independent), 16 lanes an instruction.
template <int G, int V>
static inline void weigh_wide(const float* const* p, const float* vb, size_t vt, int t0, int t1,
                              int d0, float* const* acc) {
  f8x2 a[G][V];
  for (int g = 0; g < G; g++) {
    for (int v = 0; v < V; v++) {
      a[g][v] = *(const f8x2u*)(acc[g] + d0 + 16 * v);
    }
  }
  for (int t = t0; t < t1; t++) {
    const float* vr = vb + t * vt + d0;
    for (int v = 0; v < V; v++) {
      f8x2 x = *(const f8x2u*)(vr + 16 * v);
      asm("" : "+v"(x));  // one load for the G heads (else GCC folds one into each product)
      for (int g = 0; g < G; g++) {
        a[g][v] = a[g][v] + p[g][t] * x;
      }
    }
  }
  for (int g = 0; g < G; g++) {
    for (int v = 0; v < V; v++) {
      *(f8x2u*)(acc[g] + d0 + 16 * v) = a[g][v];
    }
  }
}
#endif

// acc[g] += p[g][t] * value t over t0 <= t < t1 in order, for G query heads: V vectors of each
// head's sums in registers at a time, each value vector read once for the group.
template <int G, int V>
static void weigh_keys(const float* const* p, const float* vb, size_t vt, int t0, int t1, int D,
                       float* const* acc) {
  int d0 = 0;
#if defined(__AVX512F__)
  for (; d0 + 128 <= D; d0 += 128) {
    weigh_wide<G, 8>(p, vb, vt, t0, t1, d0, acc);
  }
  for (; d0 + 64 <= D; d0 += 64) {
    weigh_wide<G, 4>(p, vb, vt, t0, t1, d0, acc);
  }
  for (; d0 + 16 <= D; d0 += 16) {
    weigh_wide<G, 1>(p, vb, vt, t0, t1, d0, acc);
  }
#endif
  for (; d0 + 8 * V <= D; d0 += 8 * V) {
    f8 a[G][V];
    for (int g = 0; g < G; g++) {
      for (int v = 0; v < V; v++) {
        a[g][v] = load8(acc[g] + d0 + 8 * v);
      }
    }
    for (int t = t0; t < t1; t++) {
      const float* vr = vb + t * vt + d0;
      for (int v = 0; v < V; v++) {
        const f8 x = load8(vr + 8 * v);
        for (int g = 0; g < G; g++) {
          a[g][v] = a[g][v] + p[g][t] * x;
        }
      }
    }
    for (int g = 0; g < G; g++) {
      for (int v = 0; v < V; v++) {
        store8(acc[g] + d0 + 8 * v, a[g][v]);
      }
    }
  }
  for (; d0 + 8 <= D; d0 += 8) {  // what is left of D: a vector at a time, then lanes
    for (int g = 0; g < G; g++) {
      f8 a = load8(acc[g] + d0);
      for (int t = t0; t < t1; t++) {
        a = a + p[g][t] * load8(vb + t * vt + d0);
      }
      store8(acc[g] + d0, a);
    }
  }
  for (int g = 0; g < G; g++) {
    for (int t = t0; t < t1; t++) {
      for (int d = d0; d < D; d++) {
        acc[g][d] += p[g][t] * vb[t * vt + d];
      }
    }
  }
}

// ---------------------------------------------------------------- attention

// Keys per piece of attention work. Pieces start at fixed positions (0, KEYS, 2 KEYS, ...),
// so how a row's keys are split, and so its sums, never depend on the pass's other rows.
constexpr int KEYS = 256;

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
// f.template operator()<G>() for a group of min(left, HEADS) query heads.
template <typename F>
static inline void by_heads(int left, F&& f) {
  static_assert(HEADS <= 3);
  if (left >= 3 && HEADS >= 3) {
    f.template operator()<HEADS>();
  } else if (left >= 2) {
    f.template operator()<2>();
  } else {
    f.template operator()<1>();
  }
}

// Scores of the next query heads (of `left`); returns how many it scored.
static inline int score_heads(int left, const float* const* q, const float* kb, size_t kt, int t0,
                              int t1, int D, float* const* s) {
#if defined(__AVX512F__)
  if (left >= 6) {
    score_pairs<3>(q, kb, kt, t0, t1, D, s);
    return 6;
  } else if (left >= 4) {
    score_pairs<2>(q, kb, kt, t0, t1, D, s);
    return 4;
  } else if (left >= 2) {
    score_pairs<1>(q, kb, kt, t0, t1, D, s);
    return 2;
  }
#endif
  int done = 0;
  by_heads(left, [&]<int G>() {
    score_keys<G>(q, kb, kt, t0, t1, D, s);
    done = G;
  });
  return done;
}

void attend_rows(const mx::array& q, const mx::array& k, const mx::array& v, const bool* mask,
                 float scale, bool causal, float* y) {
  std::vector<float> qs;
  const int L = q.shape(2);
  attend_query_rows(rows_of(q, qs), q.shape(1), L, 0, L, q.shape(3), k, v, k.shape(2), mask,
                    scale, causal, y);
}

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
