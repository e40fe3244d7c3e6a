// Int8 products of 5 to 8 rows of x by 4-bit weights in groups of 64 (AVX-512 VNNI): q8_chunk's
// transposes (cpu_qint8.cpp, a vector 4 weights of each of 16 rows) kept in registers, each used
// at once by every row of x, with no buffer between; and the row kernels' prefetches
// (cpu_q4rows.cpp), the next 16-row block into L2, so that the weight stream runs under the
// dot products instead of after them.
// The integer sums are q8_chunk's exact numbers, x in its order (quantize_x's), and the float
// steps the same, lane by lane, group by group in order: the same bits whichever kernel runs.

#include <stdexcept>

#include "common.h"
#include "qint8.h"

#if defined(MACSPEC_INT8)

namespace macspec::q8 {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

// Fewer rows: cpu_q4rows.cpp's kernels; more: q8_chunk, whose buffer serves up to 16 rows.
constexpr int MIN_ROWS = 5, MAX_ROWS = 8;

// The lines of 16 weight rows that a later group reads, and the same place of the next 16-row
// block (into L2: it is used a block later).
inline void prefetch(const uint8_t* const* rp, size_t at, size_t block) {
  for (int r = 0; r < 16; r++) {
    __builtin_prefetch(rp[r] + at + 512);
    _mm_prefetch(reinterpret_cast<const char*>(rp[r] + at + block), _MM_HINT_T1);
  }
}

// acc[m][h] += 16 bytes at `at` of the block's rows times x's 8 dwords of them (x: dword v of
// row m at x[v * M + m]), the 8 vectors split over two sums.
template <int MR>
inline void column(const uint8_t* const* rp, size_t at, const int32_t* x, int M, vi (*acc)[2]) {
  vi t[4];
  transpose(rp, at, t);
  for (int c = 0; c < 4; c++) {
    const vi lo = nibbles_lo(t[c]), hi = nibbles_hi(t[c]);
    for (int m = 0; m < MR; m++) {
      acc[m][0] = dot(acc[m][0], lo, x + 2 * c * M + m);
      acc[m][1] = dot(acc[m][1], hi, x + (2 * c + 1) * M + m);
    }
  }
}

// Rows [n0, n1) of y for MR rows of x.
template <ScaleType T, int MR>
void wide_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  const int groups = p.K / 64, M = xq.M;
  const size_t row_bytes = (size_t)p.K / 2;
  alignas(64) float scale[16 * 16], bias[16 * 16], facc[MR * 16];
  for (int nb = n0; nb < n1; nb += 16) {
    const int rows = std::min(16, n1 - nb);
    const uint8_t* rp[16];
    size_t srow[16];
    block_rows(p, nb, rows, row_bytes, rp, srow);
    std::fill(facc, facc + MR * 16, 0.0f);
    for (int g = 0; g < groups; g++) {
      if (g % 16 == 0) {
        scale_tile<T>(p.scales, srow, groups, g, scale);
        scale_tile<T>(p.biases, srow, groups, g, bias);
      }
      const size_t at = (size_t)g * 32;
      if (g % 2 == 0) {
        prefetch(rp, at, 16 * row_bytes);
      }
      vi acc[MR][2];
      for (int m = 0; m < MR; m++) {
        acc[m][0] = acc[m][1] = zero();
      }
      const int32_t* x = xq.q.data() + (size_t)g * 16 * M;
      column<MR>(rp, at, x, M, acc);
      column<MR>(rp, at + 16, x + 8 * M, M, acc);
      const vf s = loadf(scale + g % 16 * 16), b = loadf(bias + g % 16 * 16);
      for (int m = 0; m < MR; m++) {
        const size_t i = (size_t)g * M + m;
        const vf f = accumulate(loadf(facc + m * 16), add(acc[m][0], acc[m][1]), s, xq.d[i], b,
                                xq.ds[i]);
        storef(facc + m * 16, f);
      }
    }
    for (int m = 0; m < MR; m++) {
      std::copy(facc + m * 16, facc + m * 16 + rows, p.y + (size_t)m * p.N + nb);
    }
  }
}

template <ScaleType T, int MR = MAX_ROWS>
void wide_dispatch(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  if constexpr (MR > 1) {
    if (p.M < MR) {
      wide_dispatch<T, MR - 1>(p, xq, n0, n1);
      return;
    }
  }
  wide_chunk<T, MR>(p, xq, n0, n1);
}

}  // namespace

bool q4_wide_run(const QProduct& p) {
  return p.bits == 4 && p.group == 64 && p.K % 128 == 0 && p.M >= MIN_ROWS && p.M <= MAX_ROWS;
}

template <ScaleType T>
void q4_wide_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  wide_dispatch<T>(p, xq, n0, n1);
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
