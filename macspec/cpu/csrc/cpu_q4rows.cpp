// Int8 products of 1 to 4 rows of x by 4-bit weights in groups of 64 (AVX-512 VNNI), without
// q8_chunk's 16 x 16 byte transposes (cpu_qint8.cpp), whose shuffles cost more than reading the
// weights at these row counts (5-8 rows: cpu_q4wide.cpp). The kernel (row_pass) reads 64 bytes
// (two groups) of 16 weight rows at a time, a vector a weight row, as it lies, the rows addressed
// from a few registers (qdot.h's Block); its 16 lanes summed per group after the dot products
// (pair_sums, sum_lanes), once per row of x. It prefetches the next 16-row block into L2 as well:
// the hardware prefetcher does not follow 16 interleaved streams far enough ahead to keep the
// memory busy.
// The integer sums are q8_chunk's exact numbers and the float steps the same, lane by lane,
// group by group in order: the same bits whichever kernel runs.

#include <vector>

#include "common.h"
#include "qint8.h"

#if defined(MACSPEC_INT8)  // else the float products take every product

namespace macspec::q8 {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

// The line of a weight row that the loads read two groups after `at`'s (`row` is at `at`), and
// the same place of the next 16-row block (into L2: it is used a block later).
inline void prefetch(const uint8_t* row, size_t block) {
  __builtin_prefetch(row + 512);
  _mm_prefetch(reinterpret_cast<const char*>(row + block), _MM_HINT_T1);
}

// The first level of sum_lanes for weight rows 2k, 2k + 1 (A0, A1): their dwords packed into
// words, neighbouring words added (vpmaddwd), two instructions for two vectors where unpacking
// took three. Exact: a lane of A is 8 products of at most 15 * 127 (|sum| <= 15240) and two of
// them fit a word as well (30480), so no pack saturates; integer adds, in any order.
inline __m512i pair_sums(__m512i A0, __m512i A1) {
  return _mm512_madd_epi16(_mm512_packs_epi32(A0, A1), _mm512_set1_epi16(1));
}

// B[k] = pair_sums of weight rows 2k, 2k + 1, whose lanes 0-7 hold partial sums over one group
// and 8-15 over the next one; out the two groups' sums, row r in lane r.
inline void sum_lanes(const __m512i* B, __m512i& first, __m512i& second) {
  __m512i C[4];
  for (int j = 0; j < 4; j++) {  // quarter q: rows 4j..4j+3 over the quarter's lanes
    C[j] = pair_sums(B[2 * j], B[2 * j + 1]);
  }
  const __m512i E01 = _mm512_add_epi32(_mm512_shuffle_i32x4(C[0], C[1], 0x88),
                                       _mm512_shuffle_i32x4(C[0], C[1], 0xdd));
  const __m512i E23 = _mm512_add_epi32(_mm512_shuffle_i32x4(C[2], C[3], 0x88),
                                       _mm512_shuffle_i32x4(C[2], C[3], 0xdd));
  first = _mm512_shuffle_i32x4(E01, E23, 0x88);
  second = _mm512_shuffle_i32x4(E01, E23, 0xdd);
}

inline __m512i lo_nibbles(__m512i w) {
  return _mm512_and_si512(w, _mm512_set1_epi8(15));
}
inline __m512i hi_nibbles(__m512i w) {
  return _mm512_and_si512(_mm512_srli_epi32(w, 4), _mm512_set1_epi8(15));
}

// hi_nibbles in one instruction where the CPU has GFNI (a bit matrix moving bits 4-7 of each
// byte to 0-3): row_pass splits every weight byte, a third of its arithmetic.
inline __m512i high_nibbles(__m512i w) {
#if defined(__GFNI__)
  return _mm512_gf2p8affine_epi64_epi8(w, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
  return hi_nibbles(w);
#endif
}

// One pair of groups (g, g + 1) of a 16-row block: x's dwords of the pair in q4_rows_prepare's
// order (32 a row of x) and the groups' scales and biases (16 each, group g's first).
struct Pair {
  const int32_t* x;
  const float* scale;
  const float* bias;
  int g;
};

// f += the two groups' sums s0 (group g) then s1, for row m of MR rows of x.
template <int MR>
inline vf add_pair(vf f, __m512i s0, __m512i s1, const Pair& p, const QuantizedX& xq, int m) {
  const size_t at = (size_t)p.g * MR + m;
  f = accumulate(f, vi{s0}, loadf(p.scale), xq.d[at], loadf(p.bias), xq.ds[at]);
  return accumulate(f, vi{s1}, loadf(p.scale + 16), xq.d[at + MR], loadf(p.bias + 16),
                    xq.ds[at + MR]);
}

// The two groups at `at` of the block's 16 weight rows, for MR rows of x: two weight rows at a
// time, each loaded, split into nibbles and multiplied by every row of x, their sums packed at
// once (pair_sums), so that few vectors are live (holding all 16 rows' nibbles spilled them).
template <int MR>
inline void row_pass(const Block& k, size_t at, size_t block, const Pair& p,
                     const QuantizedX& xq, vf* f) {
  __m512i xl[MR], xh[MR], B[MR][8];
  for (int m = 0; m < MR; m++) {  // x's low nibbles' columns, then the high ones'
    xl[m] = _mm512_loadu_si512(p.x + 32 * m);
    xh[m] = _mm512_loadu_si512(p.x + 32 * m + 16);
  }
  for (int i = 0; i < 8; i++) {
    __m512i A[MR][2];
    for (int h = 0; h < 2; h++) {
      const uint8_t* row = k.row(2 * i + h) + at;
      prefetch(row, block);
      const __m512i w = _mm512_loadu_si512(row);
      const __m512i lo = lo_nibbles(w), hi = high_nibbles(w);
      for (int m = 0; m < MR; m++) {
        const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl[m]);
        A[m][h] = _mm512_dpbusd_epi32(a, hi, xh[m]);
      }
    }
    for (int m = 0; m < MR; m++) {
      B[m][i] = pair_sums(A[m][0], A[m][1]);
    }
  }
  for (int m = 0; m < MR; m++) {
    __m512i s0, s1;
    sum_lanes(B[m], s0, s1);
    f[m] = add_pair<MR>(f[m], s0, s1, p, xq, m);
  }
}

// scale_tile's two tables (scales, biases) of 16-bit scales at once: row r's 16 scales and 16
// biases as one vector of dwords, one 16 x 16 transpose for both (not one each), then each
// dword's halves as floats, converted as load_scales converts them (groups past the last are 0).
template <ScaleType T>
void scale_bias_tile(const QProduct& p, const size_t* srow, int groups, int g0, float* scale,
                     float* bias) {
  const auto* sc = static_cast<const uint16_t*>(p.scales);
  const auto* bi = static_cast<const uint16_t*>(p.biases);
  const int n = std::min(16, groups - g0);
  const __mmask16 k = (__mmask16)((1u << n) - 1);
  vf rows[16];
  for (int r = 0; r < 16; r++) {
    const size_t at = srow[r] * groups + g0;
    const __m256i s = _mm256_maskz_loadu_epi16(k, sc + at);
    const __m256i b = _mm256_maskz_loadu_epi16(k, bi + at);
    rows[r] = {_mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(s), b, 1))};
  }
  transpose(rows);  // rows[c] lane r: row r's groups 2c and 2c + 1 (c < 8), or their biases
  for (int c = 0; c < 16; c++) {
    const int j = 2 * (c % 8);
    float* out = (c < 8 ? scale : bias) + 16 * j;
    const __m512i d = _mm512_castps_si512(rows[c].v);
    if constexpr (T == ScaleType::bf16) {  // the top half of a float32
      _mm512_store_si512(out, _mm512_slli_epi32(d, 16));
      _mm512_store_si512(out + 16, _mm512_and_si512(d, _mm512_set1_epi32(-65536)));
    } else {
      _mm512_store_ps(out, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d)));
      const __m256i high = _mm512_cvtepi32_epi16(_mm512_srli_epi32(d, 16));
      _mm512_store_ps(out + 16, _mm512_cvtph_ps(high));
    }
  }
}

}  // namespace

template <ScaleType T>
void q4_rows_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  // (generic, so that only 16-bit scales instantiate scale_bias_tile)
  const auto tiles = [&](auto... tile) { scale_bias_tile<T>(p, tile...); };
  const auto pass = [&]<int MR>(const Block& k, int g, size_t next, const float* scale,
                                const float* bias, vf* f) {  // groups g and g + 1
    const Pair pair{xq.rows.data() + (size_t)g * 16 * MR, scale, bias, g};
    row_pass<MR>(k, (size_t)g * 32, next, pair, xq, f);
  };
  q4_rows_blocks<T, 2>(p, n0, n1, tiles, pass);
}

template void q4_rows_chunk<ScaleType::f32>(const QProduct&, const QuantizedX&, int, int);
template void q4_rows_chunk<ScaleType::f16>(const QProduct&, const QuantizedX&, int, int);
template void q4_rows_chunk<ScaleType::bf16>(const QProduct&, const QuantizedX&, int, int);

#endif  // (AVX2 without AVX-512: cpu_q4rows_avx2.cpp; AVX-512 without VNNI: q8_chunk for all)

bool q4_rows_run(const QProduct& p) {
  return Q4_ROWS && !p.packed && p.bits == 4 && p.group == 64 && p.K % 128 == 0 &&
         p.M <= Q4_ROWS_MAX;
}

// Per pair of groups and row of x, 32 dwords: the 16 of the columns the weights' low nibbles
// hold (quantize_x's even dwords: it orders each 8 columns as the nibbles unpack), then the 16
// of the high ones.
void q4_rows_prepare(const QProduct& p, QuantizedX& xq) {
  const int M = p.M;
  xq.rows.resize((size_t)p.K / 4 * M);
  for (int gp = 0; gp < p.K / 128; gp++) {
    for (int m = 0; m < M; m++) {
      int32_t* out = xq.rows.data() + ((size_t)gp * M + m) * 32;
      for (int i = 0; i < 16; i++) {
        out[i] = xq.q[(size_t)(gp * 32 + 2 * i) * M + m];
        out[16 + i] = xq.q[(size_t)(gp * 32 + 2 * i + 1) * M + m];
      }
    }
  }
}

}  // namespace macspec::q8

#endif  // MACSPEC_INT8
