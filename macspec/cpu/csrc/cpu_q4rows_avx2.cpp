// cpu_q4rows.cpp's row kernel for CPUs with AVX2 but without AVX-512 (most AMD EPYC before Zen 4,
// Intel client cores): int8 products of 1 to 8 rows of x by 4-bit weights in groups of 64.
// q8_chunk (cpu_qint8.cpp) first transposes 16 weight rows into a buffer of unpacked bytes and
// reads them back; at a few rows of x those shuffles, stores and reloads took most of a step
// (the weights cost less to read than to rearrange). Here each weight row's 32 bytes of a group are
// used as they lie: nibbles against x's columns (vpmaddubsw, exact: 2 * 15 * 127 fits a word),
// the 8 lanes of each row summed per group (sum_lanes8), rows 0-7 and 8-15 in one vector each.
// The integer sums are q8_chunk's exact numbers and the float steps the same (qdot.h's
// accumulate, lane by lane, group by group in order): the same bits whichever kernel runs.

#include "common.h"
#include "qint8.h"

#if defined(MACSPEC_INT8) && !(defined(__AVX512F__) && defined(__AVX512BW__))

namespace macspec::q8 {

namespace {

// 8 weight rows' partial sums over one group (A[r]: 8 dwords, each of 8 products, so
// |a| <= 8 * 15 * 127 = 15240) -> one vector of their totals, row r in lane r. Two levels pack
// two vectors' dwords into words and add neighbouring words (vpmaddwd with ones): exact, as the
// sums stay within a word before each pack (15240, then 30480).
inline __m256i sum_lanes8(const __m256i* A) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i B[4];
  for (int k = 0; k < 4; k++) {  // per 128-bit half h: row 2k's lanes (0+1, 2+3), row 2k+1's
    B[k] = _mm256_madd_epi16(_mm256_packs_epi32(A[2 * k], A[2 * k + 1]), ones);
  }
  // per half h: rows 4j..4j+3, each over its lanes 4h..4h+3
  const __m256i C0 = _mm256_madd_epi16(_mm256_packs_epi32(B[0], B[1]), ones);
  const __m256i C1 = _mm256_madd_epi16(_mm256_packs_epi32(B[2], B[3]), ones);
  return _mm256_add_epi32(_mm256_permute2x128_si256(C0, C1, 0x20),
                          _mm256_permute2x128_si256(C0, C1, 0x31));
}

// Rows r0..r0+7's sums over the 32 bytes at `at` (one group), for MR rows of x: xl[m] the
// columns of the low nibbles, xh[m] of the high ones.
template <int MR>
inline void group8(const Block& k, int r0, size_t at, const __m256i* xl, const __m256i* xh,
                   __m256i* out) {
  const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i A[MR][8];
  for (int r = 0; r < 8; r++) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(k.row(r0 + r) + at));
    const __m256i lo = _mm256_and_si256(w, m15);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m15);
    for (int m = 0; m < MR; m++) {
      const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[m]),
                                         _mm256_maddubs_epi16(hi, xh[m]));
      A[m][r] = _mm256_madd_epi16(s, ones);
    }
  }
  for (int m = 0; m < MR; m++) {
    out[m] = sum_lanes8(A[m]);
  }
}

// f[m] += group g's sums of the 16-row block, for MR rows of x. `x`: the pair of groups' dwords
// (q4_rows_prepare's order: per row of x, 16 of the low nibbles' columns, then 16 of the high
// ones, group g's 8 first when g is even); `scale`, `bias`: the group's 16 lanes.
template <int MR>
inline void group_pass(const Block& k, int g, const int32_t* x, const float* scale,
                       const float* bias, const QuantizedX& xq, vf* f) {
  __m256i xl[MR], xh[MR];
  const int half = 8 * (g % 2);
  for (int m = 0; m < MR; m++) {
    xl[m] = _mm256_loadu_si256((const __m256i*)(x + 32 * m + half));
    xh[m] = _mm256_loadu_si256((const __m256i*)(x + 32 * m + 16 + half));
  }
  const size_t at = (size_t)g * 32;
  __m256i lo[MR], hi[MR];
  group8<MR>(k, 0, at, xl, xh, lo);
  group8<MR>(k, 8, at, xl, xh, hi);
  const vf sc = loadf(scale), bi = loadf(bias);
  for (int m = 0; m < MR; m++) {
    const size_t i = (size_t)g * xq.M + m;
    f[m] = accumulate(f[m], vi{lo[m], hi[m]}, sc, xq.d[i], bi, xq.ds[i]);
  }
}

// The lines of 16 weight rows the next pair of groups reads (two ahead), and the same place of
// the next 16-row block, into L2 (used a block later), as cpu_q4rows.cpp does.
inline void prefetch(const Block& k, size_t at, size_t block) {
  for (int r = 0; r < 16; r++) {
    __builtin_prefetch(k.row(r) + at + 256);
    _mm_prefetch(reinterpret_cast<const char*>(k.row(r) + at + block), _MM_HINT_T1);
  }
}

// Two words of each dword of d as floats (the low ones, then the high ones), converted as
// load_scales converts 16-bit scales.
template <ScaleType T>
inline void halves(__m256i d, __m256& first, __m256& second) {
  if constexpr (T == ScaleType::bf16) {  // the top half of a float32
    first = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
    second = _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(-65536)));
  } else {  // 8 words packed in order (packus is exact: each is at most 0xffff)
    const auto words = [](__m256i v) {
      return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08));
    };
    first = _mm256_cvtph_ps(words(_mm256_and_si256(d, _mm256_set1_epi32(0xffff))));
    second = _mm256_cvtph_ps(words(_mm256_srli_epi32(d, 16)));
  }
}

// scale_tile's two tables of 16-bit scales with one 16 x 16 transpose for both (as
// cpu_q4rows.cpp's): row r's 16 scales and 16 biases as 16 dwords, transposed, each dword's
// halves then as floats (groups past the last are 0). At one row of x, scale_tile's two
// transposes took an eighth of a step.
template <ScaleType T>
void scale_bias_tile(const QProduct& p, const size_t* srow, int groups, int g0, float* scale,
                     float* bias) {
  const auto* sc = static_cast<const uint16_t*>(p.scales);
  const auto* bi = static_cast<const uint16_t*>(p.biases);
  const int n = std::min(16, groups - g0);
  vf rows[16];
  for (int r = 0; r < 16; r++) {
    const uint16_t *s = sc + srow[r] * groups + g0, *b = bi + srow[r] * groups + g0;
    alignas(32) uint16_t part[32] = {};
    if (n < 16) {
      std::copy(s, s + n, part);
      std::copy(b, b + n, part + 16);
      s = part, b = part + 16;
    }
    rows[r] = {_mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)s)),
               _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)b))};
  }
  transpose(rows);  // rows[c] row r: row r's groups 2c and 2c + 1 (c < 8), or their biases
  for (int c = 0; c < 16; c++) {
    float* out = (c < 8 ? scale : bias) + 16 * 2 * (c % 8);
    __m256 lo0, lo1, hi0, hi1;
    halves<T>(_mm256_castps_si256(rows[c].lo), lo0, lo1);
    halves<T>(_mm256_castps_si256(rows[c].hi), hi0, hi1);
    storef(out, vf{lo0, hi0});
    storef(out + 16, vf{lo1, hi1});
  }
}

}  // namespace

template <ScaleType T>
void q4_rows_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  // (generic, so that only 16-bit scales instantiate scale_bias_tile)
  const auto tiles = [&](auto... tile) { scale_bias_tile<T>(p, tile...); };
  const auto pass = [&]<int MR>(const Block& k, int g, size_t next, const float* scale,
                                const float* bias, vf* f) {
    if (g % 2 == 0) {
      prefetch(k, (size_t)g * 32, next);
    }
    const int32_t* x = xq.rows.data() + (size_t)(g / 2) * 32 * MR;
    group_pass<MR>(k, g, x, scale, bias, xq, f);
  };
  q4_rows_blocks<T, 1>(p, n0, n1, tiles, pass);
}

template void q4_rows_chunk<ScaleType::f32>(const QProduct&, const QuantizedX&, int, int);
template void q4_rows_chunk<ScaleType::f16>(const QProduct&, const QuantizedX&, int, int);
template void q4_rows_chunk<ScaleType::bf16>(const QProduct&, const QuantizedX&, int, int);

}  // namespace macspec::q8

#endif
