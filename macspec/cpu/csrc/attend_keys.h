// The inner loops of attention (cpu_attention.cpp): query heads' scores against a stretch of
// keys, and the values weighed by them, in groups that read a key or value row once. Every sum
// is taken in one fixed order, whatever the group, so a row's bits never depend on its company.

#pragma once

#include <immintrin.h>

#include <cmath>

#include "layer.h"

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

}  // namespace macspec
