// Int8 products of 3 to 8 rows of x by 4-bit weights in groups of 64 (AVX-512 VNNI; 1-4 rows
// take cpu_q4rows.cpp's kernel first, which costs less there): q8_chunk's
// transposes (cpu_qint8.cpp, a vector 4 weights of each of 16 rows) kept in registers, each used
// at once by every row of x, with no buffer between; x's offsets known at compile time (x has
// MR rows); the rows addressed from a few registers; and the next 16-row block prefetched into
// L2, as cpu_q4rows.cpp does, so that the weight stream runs under the dot products.
// The integer sums are q8_chunk's exact numbers, x in its order (quantize_x's), and the float
// steps the same, lane by lane, group by group in order: the same bits whichever kernel runs.

#include <stdexcept>
#include <vector>

#include "common.h"
#include "qint8.h"

#if defined(MACSPEC_INT8)

namespace macspec::q8 {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

// Fewer rows: cpu_q4rows.cpp's kernel; more: q8_chunk, whose buffer serves up to 16 rows.
constexpr int MIN_ROWS = 3, MAX_ROWS = 8;

// acc[m][0] += 16 bytes at `at` of the block's rows (low nibbles) times x's dwords of them,
// acc[m][1] the high nibbles' (x: dword v of row m at x[v * MR + m]; 6-16 sums under way).
template <int MR>
inline void column(const Block& k, size_t at, const int32_t* x, vi (*acc)[2]) {
  vi t[4];
  transpose(k, at, t);
  for (int c = 0; c < 4; c++) {
    const vi lo = nibbles_lo(t[c]), hi = nibbles_hi(t[c]);
    for (int m = 0; m < MR; m++) {
      acc[m][0] = dot(acc[m][0], lo, x + 2 * c * MR + m);
      acc[m][1] = dot(acc[m][1], hi, x + (2 * c + 1) * MR + m);
    }
  }
}

// The line at `at` of the next block's rows, into L2: used a block later (the hardware
// prefetcher does not follow 16 interleaved streams far enough ahead).
inline void prefetch(const Block& k, size_t at, size_t block) {
  for (int r = 0; r < 16; r++) {
    _mm_prefetch(reinterpret_cast<const char*>(k.row(r) + at + block), _MM_HINT_T1);
  }
}

// Rows [n0, n1) of y for the MR rows of x.
template <ScaleType T, int MR>
void wide_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  const int groups = p.K / 64;
  const size_t row_bytes = (size_t)p.K / 2;
  alignas(64) float scale[16 * 16], bias[16 * 16], facc[MR * 16];
  std::vector<uint8_t> pad;
  for (int nb = n0; nb < n1; nb += 16) {
    const int rows = std::min(16, n1 - nb);
    size_t srow[16];  // the scales' rows
    const Block k = block_at(p, nb, rows, row_bytes, srow, pad);
    std::fill(facc, facc + MR * 16, 0.0f);
    for (int g = 0; g < groups; g++) {
      if (g % 16 == 0) {
        scale_tile<T>(p.scales, srow, groups, g, scale);
        scale_tile<T>(p.biases, srow, groups, g, bias);
      }
      const size_t at = (size_t)g * 32;
      if (g % 2 == 0 && rows == 16) {
        prefetch(k, at, 16 * row_bytes);
      }
      vi acc[MR][2];
      for (int m = 0; m < MR; m++) {
        acc[m][0] = acc[m][1] = zero();
      }
      const int32_t* x = xq.q.data() + (size_t)g * 16 * MR;
      column<MR>(k, at, x, acc);
      column<MR>(k, at + 16, x + 8 * MR, acc);
      const vf s = loadf(scale + g % 16 * 16), b = loadf(bias + g % 16 * 16);
      for (int m = 0; m < MR; m++) {
        const size_t i = (size_t)g * MR + m;
        const vi sum = add(acc[m][0], acc[m][1]);
        storef(facc + m * 16, accumulate(loadf(facc + m * 16), sum, s, xq.d[i], b, xq.ds[i]));
      }
    }
    for (int m = 0; m < MR; m++) {
      std::copy(facc + m * 16, facc + m * 16 + rows, p.y + (size_t)m * p.N + nb);
    }
  }
}

}  // namespace

bool q4_wide_run(const QProduct& p) {
  return p.bits == 4 && p.group == 64 && p.K % 128 == 0 && p.M >= MIN_ROWS && p.M <= MAX_ROWS;
}

template <ScaleType T>
void q4_wide_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  with_rows<MAX_ROWS>(p.M, [&]<int MR>() { wide_chunk<T, MR>(p, xq, n0, n1); });
}

#else  // no AVX-512 VNNI: q8_chunk takes every product

bool q4_wide_run(const QProduct&) {
  return false;
}

template <ScaleType T>
void q4_wide_chunk(const QProduct&, const QuantizedX&, int, int) {
  throw std::logic_error("[macspec products] no wide row kernel on this build");
}

#endif

template void q4_wide_chunk<ScaleType::f32>(const QProduct&, const QuantizedX&, int, int);
template void q4_wide_chunk<ScaleType::f16>(const QProduct&, const QuantizedX&, int, int);
template void q4_wide_chunk<ScaleType::bf16>(const QProduct&, const QuantizedX&, int, int);

}  // namespace macspec::q8

#endif  // MACSPEC_INT8
