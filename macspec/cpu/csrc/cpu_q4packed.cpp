// 4-bit weights in groups of 64 or 32 (AVX-512: 8-bit too) repacked once, at load, for the int8
// products (AVX-512, AVX2):
// each 16-row block's words transposed ahead of time, so that a vector holds one word (8 weights)
// of each of its 16 rows, as q8_chunk's and cpu_q4wide.cpp's transposes make them on the fly in
// every pass; and its scales and biases 16 rows to a group, as their scale tables do. A pass then
// reads one stream a thread with no shuffles: the transposes were about half of a 5-row pass's
// instructions (docs/cpu.md, "Weights repacked at load"). The integer sums are q8_chunk's exact
// numbers and the float steps the same, lane by lane, group by group in order: the same bits.
//
//   W (N, K / 8) uint32      -> (N / 16, K / G, WG * 16): [b][g][c * 16 + r] = W[16b + r][WG g + c]
//   scales, biases (N, K / G) -> (N / 16, K / G, 16): [b][g][r] = S[16b + r][g]
// for groups of G = 64 (WG = 8 words a group) or 32 (WG = 4: a GGUF's Q4_K, models/gguf_blocks.py).
// (products.py repacks with MLX's own transposes.)
//
// Float32 scales and biases that are, 8 groups at a time, one float times integers (a GGUF's
// K-quant blocks kept: d * sc for Q4_K's 6-bit sc, d * sc / 4 for Q6_K's int8 sc) are stored
// factored (ScaleType::i8; products.py checks each value's bits when it factors them):
//   (N / 16, K / G + K / G / 2, 16) int8: a block's K / G rows of integers [g][r], then its floats
//   as bytes, [K / G / 8][16] float32. S[16b + r][g] = float(int[g][r]) * float[g / 8][r], one
//   float32 product, which rounds to the stored value exactly. 24 bits a group of 32 instead of
//   two 32-bit floats: the 1.5B Q4_K_M target reads 1.13 GB a token instead of 1.37.

#include <algorithm>
#include <vector>

#include "common.h"
#include "qint8.h"

#if defined(MACSPEC_INT8)

namespace macspec::q8 {

namespace {

// Into L1: the words 2 KB ahead (group g + 4 of 64 weights; further ahead measured slower), and
// the scales and biases of group g + 16 (a line holds 2-4 groups' of them). `w`: group g's.
template <int WG, typename E>
inline void prefetch_ahead(const uint32_t* w, const E* s, const E* bs, int g) {
  for (int l = 0; l < WG; l++) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * 128 + 16 * l), _MM_HINT_T0);
  }
  _mm_prefetch(reinterpret_cast<const char*>(s + (g + 16) * 16), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(bs + (g + 16) * 16), _MM_HINT_T0);
}

// Block b's scale (or bias) table: its first of `groups` rows of 16.
template <ScaleType T>
inline const scale_elem<T>* block_table(const void* a, int b, int groups) {
  const size_t rows = T == ScaleType::i8 ? groups + groups / 2 : groups;
  return static_cast<const scale_elem<T>*>(a) + (size_t)b * rows * 16;
}

// Group g's 16 scales (or biases) of a block's table as floats.
template <ScaleType T>
inline vf group_table(const scale_elem<T>* t, int g, int groups) {
  if constexpr (T == ScaleType::i8) {
    const float* f = reinterpret_cast<const float*>(t + groups * 16) + (g / 8) * 16;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + g * 16));
#if defined(__AVX512F__) && defined(__AVX512BW__)  // qdot.h's vf
    return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_loadu_ps(f))};
#else
    return {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(f)),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))),
                          _mm256_loadu_ps(f + 8))};
#endif
  } else {
    return load_scales(t + g * 16, 16);
  }
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__)

namespace {

constexpr int MR_MAX = 8;  // rows of x a pass over a block keeps sums for (the registers hold 8)

// Group g's integer sums for MR rows of x (acc[m][0]) without VNNI: vpmaddubsw pairs of at most
// 2 * 15 * 127, 8 of them (4 words' low and high nibbles) summed in int16 lanes before widening
// (qdot.h's dot16): exact, the same integers as vpdpbusd's.
template <int WG, int MR, int C>
inline void group_sums16(const uint32_t* w, const int32_t* x, int M, vi (*acc)[C]) {
  for (int c4 = 0; c4 < WG; c4 += 4) {
    vs s[MR];
    for (int m = 0; m < MR; m++) {
      s[m] = zero16();
    }
    for (int c = c4; c < c4 + 4; c++) {
      const vi v = {_mm512_loadu_si512(w + c * 16)};
      const vi lo = nibbles_lo(v), hi = nibbles_hi(v);
      for (int m = 0; m < MR; m++) {
        s[m] = dot16(dot16(s[m], lo, x + 2 * c * M + m), hi, x + (2 * c + 1) * M + m);
      }
    }
    for (int m = 0; m < MR; m++) {
      acc[m][0] = widen(acc[m][0], s[m]);
    }
  }
}

// Group g's integer sums of the block's 16 rows for MR rows of x, one vector a row. A 4-bit word
// holds 8 weights of one row (x's dwords 2c and 2c + 1 meet its low and high nibbles), an 8-bit
// one 4 (x's dword c): vpdpbusd takes the unsigned bytes as they are; without VNNI 8-bit weights
// go in as q - 128 (prepare), and the caller adds 128 * sum x back, as q8_chunk does.
template <int BITS, int WG, int MR>
inline void group_sums(const uint32_t* w, const int32_t* x, int M, vi* sum) {
  // independent sums a row: ~10 products under way (group_sums16 chains its own)
  constexpr int CH = BITS == 4 ? (VNNI ? (MR <= 2 ? 4 : 2) : 1) : (MR <= 2 ? 2 : 1);
  vi acc[MR][CH];
  for (int m = 0; m < MR; m++) {
    for (int c = 0; c < CH; c++) {
      acc[m][c] = zero();
    }
  }
  if constexpr (BITS == 4 && !VNNI) {
    group_sums16<WG, MR>(w, x, M, acc);
  } else {
    for (int c = 0; c < WG; c++) {
      const vi v = {_mm512_loadu_si512(w + c * 16)};
      for (int m = 0; m < MR; m++) {
        if constexpr (BITS == 4) {
          const int k = CH == 4 ? 2 * (c & 1) : 0;
          acc[m][k] = dot(acc[m][k], nibbles_lo(v), x + 2 * c * M + m);
          acc[m][k + 1] = dot(acc[m][k + 1], nibbles_hi(v), x + (2 * c + 1) * M + m);
        } else if constexpr (VNNI) {
          acc[m][c % CH] = dot(acc[m][c % CH], v, x + c * M + m);
        } else {
          acc[m][c % CH] = dot(acc[m][c % CH], prepare(flip_sign(v)), x + c * M + m);
        }
      }
    }
  }
  for (int m = 0; m < MR; m++) {
    sum[m] = acc[m][0];
    for (int c = 1; c < CH; c++) {
      sum[m] = add(sum[m], acc[m][c]);  // exact integers: the order changes nothing
    }
  }
}

// Rows [m0, m0 + MR) of y's block b (16 rows at 16b) for x's rows of the same numbers, weights
// of BITS bits, WG words a group.
template <int BITS, int WG, ScaleType T, int MR>
void block_rows(const QProduct& p, const QuantizedX& xq, int b, int m0, const scale_elem<T>* s,
                const scale_elem<T>* bs) {
  constexpr int XG = 8 * WG / BITS;  // x's dwords a group
  const int groups = p.K / (4 * XG), M = xq.M;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p.W) + (size_t)b * groups * WG * 16;
  vf facc[MR];
  for (int m = 0; m < MR; m++) {
    facc[m] = {_mm512_setzero_ps()};
  }
  for (int g = 0; g < groups; g++, w += WG * 16) {
    prefetch_ahead<WG>(w, s, bs, g);
    vi sum[MR];
    const int32_t* x = xq.q.data() + (size_t)g * XG * M + m0;  // dword v of row m: x[v * M + m]
    group_sums<BITS, WG, MR>(w, x, M, sum);
    const vf scale = group_table<T>(s, g, groups), bias = group_table<T>(bs, g, groups);
    for (int m = 0; m < MR; m++) {
      const size_t i = (size_t)g * M + m0 + m;
      if constexpr (BITS == 8 && !VNNI) {
        sum[m] = add(sum[m], 128 * xq.sum[i]);
      }
      facc[m] = accumulate(facc[m], sum[m], scale, xq.d[i], bias, xq.ds[i]);
    }
  }
  for (int m = 0; m < MR; m++) {
    _mm512_storeu_ps(p.y + (size_t)(m0 + m) * p.N + 16 * b, facc[m].v);
  }
}

}  // namespace

constexpr int PASS_ROWS = MR_MAX;  // rows of x a pass over a block takes

// Every pass over block b for x's rows [t0, t1), with its tables s and bs.
template <ScaleType T>
void block_passes(const QProduct& p, const QuantizedX& xq, int b, const scale_elem<T>* s,
                  const scale_elem<T>* bs, int t0, int t1) {
  for (int m0 = t0; m0 < t1; m0 += MR_MAX) {
    with_rows<MR_MAX>(std::min(MR_MAX, t1 - m0), [&]<int MR>() {
      if (p.bits == 8 && p.group == 32) {
        block_rows<8, 8, T, MR>(p, xq, b, m0, s, bs);
      } else if (p.bits == 8) {
        block_rows<8, 16, T, MR>(p, xq, b, m0, s, bs);
      } else if (p.group == 32) {
        block_rows<4, 4, T, MR>(p, xq, b, m0, s, bs);
      } else {
        block_rows<4, 8, T, MR>(p, xq, b, m0, s, bs);
      }
    });
  }
}

#else  // AVX2: rows 0-7 and 8-15 a register each

namespace {

constexpr int MSUPER = 16;  // rows of x whose float sums are kept at a time

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))

constexpr int MR_MAX = 4;  // rows of x a group's pass keeps sums for: 8 of 16 registers

// Group g's integer sums of the block's 16 rows for rows m..m+MR of x, as (rows 0-7, rows 8-15):
// vpdpbusd (AVX-VNNI) adds each lane's 4 products to its sum, one instruction where AVX2 takes
// about two and a quarter (below).
template <int WG, int MR>
inline void group_rows(const uint32_t* w, const int32_t* x, int M, __m256i (*acc)[2]) {
  const __m256i m15 = _mm256_set1_epi8(15);
  for (int m = 0; m < MR; m++) {
    acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  }
  for (int c = 0; c < WG; c++) {
    for (int h = 0; h < 2; h++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 16 + 8 * h));
      const __m256i lo = _mm256_and_si256(v, m15);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
      for (int m = 0; m < MR; m++) {
        acc[m][h] = dot8(acc[m][h], lo, _mm256_set1_epi32(x[2 * c * M + m]));
        acc[m][h] = dot8(acc[m][h], hi, _mm256_set1_epi32(x[(2 * c + 1) * M + m]));
      }
    }
  }
}

#else

constexpr int MR_MAX = 2;  // 16 registers

// Group g's integer sums of the block's 16 rows for rows m..m+MR of x, as (rows 0-7, rows 8-15).
// Per word a lane's bytes give vpmaddubsw pairs of at most 2 * 15 * 127 = 3,810 (low nibbles)
// plus as much (high): 16-bit sums over 4 words stay within 30,480, and are widened then. Exact
// integers, as vpdpbusd's.
template <int WG, int MR>
inline void group_rows(const uint32_t* w, const int32_t* x, int M, __m256i (*acc)[2]) {
  const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MR; m++) {
    acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  }
  for (int c4 = 0; c4 < WG; c4 += 4) {
    __m256i s[MR][2];
    for (int m = 0; m < MR; m++) {
      s[m][0] = s[m][1] = _mm256_setzero_si256();
    }
    for (int c = c4; c < c4 + 4; c++) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 16 + 8 * h));
        lo[h] = _mm256_and_si256(v, m15);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
      }
      for (int m = 0; m < MR; m++) {
        const __m256i xl = _mm256_set1_epi32(x[2 * c * M + m]);
        const __m256i xh = _mm256_set1_epi32(x[(2 * c + 1) * M + m]);
        for (int h = 0; h < 2; h++) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                             _mm256_maddubs_epi16(hi[h], xh));
          s[m][h] = _mm256_add_epi16(s[m][h], p);
        }
      }
    }
    for (int m = 0; m < MR; m++) {
      for (int h = 0; h < 2; h++) {
        acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_madd_epi16(s[m][h], ones));
      }
    }
  }
}

#endif

// Rows [m0, m0 + mc) (mc <= MSUPER) of y's block b for x's rows of the same numbers.
template <int WG, ScaleType T>
void block_rows(const QProduct& p, const QuantizedX& xq, int b, int m0, int mc,
                const scale_elem<T>* s, const scale_elem<T>* bs) {
  const int groups = p.K / (8 * WG), M = xq.M;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p.W) + (size_t)b * groups * WG * 16;
  alignas(32) float facc[MSUPER * 16] = {};
  for (int g = 0; g < groups; g++, w += WG * 16) {
    prefetch_ahead<WG>(w, s, bs, g);
    const vf scale = group_table<T>(s, g, groups), bias = group_table<T>(bs, g, groups);
    const int32_t* x = xq.q.data() + (size_t)g * 2 * WG * M + m0;  // dword v of row m: x[v * M + m]
    for (int m = 0; m < mc; m += MR_MAX) {
      __m256i acc[MR_MAX][2];
      with_rows<MR_MAX>(std::min(MR_MAX, mc - m),
                        [&]<int MR>() { group_rows<WG, MR>(w, x + m, M, acc); });
      for (int r = 0; r < std::min(MR_MAX, mc - m); r++) {
        const size_t i = (size_t)g * M + m0 + m + r;
        float* f = facc + (m + r) * 16;
        storef(f, accumulate(loadf(f), {acc[r][0], acc[r][1]}, scale, xq.d[i], bias, xq.ds[i]));
      }
    }
  }
  for (int m = 0; m < mc; m++) {
    std::copy(facc + m * 16, facc + m * 16 + 16, p.y + (size_t)(m0 + m) * p.N + 16 * b);
  }
}

}  // namespace

constexpr int PASS_ROWS = MSUPER;

template <ScaleType T>
void block_passes(const QProduct& p, const QuantizedX& xq, int b, const scale_elem<T>* s,
                  const scale_elem<T>* bs, int t0, int t1) {
  for (int m0 = t0; m0 < t1; m0 += MSUPER) {
    if (p.group == 32) {
      block_rows<4, T>(p, xq, b, m0, std::min(MSUPER, t1 - m0), s, bs);
    } else {
      block_rows<8, T>(p, xq, b, m0, std::min(MSUPER, t1 - m0), s, bs);
    }
  }
}

#endif

// x's rows a tile: the passes over each of the chunk's weight blocks read the tile's rows, which
// then stay in L2 while the blocks go by; untiled, a 512-id prompt chunk's x spilled from a
// 1 MB L2 beside the weights (docs/cpu.md). Each y is computed as before: the same bits.
constexpr int X_TILE = 128;

template <ScaleType T>
void q4_packed_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  const int groups = p.K / p.group, b0 = n0 / 16, b1 = n1 / 16;
  // Several passes over each block (a prompt's chunk) would multiply out the same factored
  // tables, about 5% of a prefill; so once, into floats, for every block of the chunk.
  float* f = nullptr;
  if constexpr (T == ScaleType::i8) {
    if (p.M > PASS_ROWS) {
      thread_local std::vector<float> room;
      room.resize((size_t)(b1 - b0) * groups * 32 + 16);
      f = room.data() + (16 - reinterpret_cast<uintptr_t>(room.data()) / 4 % 16) % 16;
      for (int b = b0; b < b1; b++) {
        const scale_elem<T>* s = block_table<T>(p.scales, b, groups);
        const scale_elem<T>* bs = block_table<T>(p.biases, b, groups);
        float* fb = f + (size_t)(b - b0) * groups * 32;
        for (int g = 0; g < groups; g++) {  // (storef: 64-byte aligned)
          storef(fb + g * 16, group_table<T>(s, g, groups));
          storef(fb + (groups + g) * 16, group_table<T>(bs, g, groups));
        }
      }
    }
  }
  for (int t0 = 0; t0 < p.M; t0 += X_TILE) {
    const int t1 = std::min(p.M, t0 + X_TILE);
    for (int b = b0; b < b1; b++) {
      if (f != nullptr) {
        const float* fb = f + (size_t)(b - b0) * groups * 32;
        block_passes<ScaleType::f32>(p, xq, b, fb, fb + groups * 16, t0, t1);
      } else {
        block_passes<T>(p, xq, b, block_table<T>(p.scales, b, groups),
                        block_table<T>(p.biases, b, groups), t0, t1);
      }
    }
  }
}

template void q4_packed_chunk<ScaleType::f32>(const QProduct&, const QuantizedX&, int, int);
template void q4_packed_chunk<ScaleType::f16>(const QProduct&, const QuantizedX&, int, int);
template void q4_packed_chunk<ScaleType::bf16>(const QProduct&, const QuantizedX&, int, int);
template void q4_packed_chunk<ScaleType::i8>(const QProduct&, const QuantizedX&, int, int);

}  // namespace macspec::q8

#endif  // MACSPEC_INT8

namespace macspec {

bool q4_packs() {  // every build with int8 products has a kernel above
#if defined(MACSPEC_INT8)
  return true;
#else
  return false;
#endif
}

bool q8_packs() {  // 8-bit weights: the AVX-512 builds (AVX2's int16 pairs would overflow)
#if defined(MACSPEC_INT8) && defined(__AVX512F__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

}  // namespace macspec
