// What the int8 products' kernels share (cpu_qint8.cpp transposes 16 weight rows; cpu_q4rows.cpp
// reads them as they lie): x as quantized, and the scales and rows of one 16-row weight block.
#pragma once

#include "qdot.h"
#include "quant.h"

#if defined(MACSPEC_INT8)

#include <algorithm>
#include <cstdint>
#include <vector>

namespace macspec::q8 {

// x quantized per group: int8 in the order the weight vectors are unpacked, 4 bytes (one dword)
// at a time, dword-major (q[v * M + m]: the rows of one pass are next to each other); and per
// group d = max|x| / 127, d * sum(q) and sum(q), group-major as well. `rows`: the same dwords in
// the row kernels' order where they run (cpu_q4rows.cpp), else empty.
struct QuantizedX {
  int M;
  std::vector<int32_t> q;  // K / 4 * M
  std::vector<float> d, ds;  // groups * M
  std::vector<int32_t> sum;  // groups * M
  std::vector<int32_t> rows;  // K / 4 * M
};

// Scales (or biases) of 16 groups from g0 of rows srow[0..15], as table[j * 16 + r].
template <ScaleType T>
void scale_tile(const void* a, const size_t* srow, int groups, int g0, float* table) {
  const auto* e = static_cast<const scale_elem<T>*>(a);
  const int n = std::min(16, groups - g0);
  vf rows[16];
  for (int r = 0; r < 16; r++) {
    rows[r] = load_scales(e + srow[r] * groups + g0, n);
  }
  transpose(rows);
  for (int j = 0; j < n; j++) {
    storef(table + j * 16, rows[j]);
  }
}

// Weight rows nb..nb+15 of one 16-row block: their row indices in srow (lanes past the last row
// repeat it, and are not stored), and the rows as a Block (qdot.h): in place, or (a last block
// of fewer than 16 rows) copied into `pad`, the last row repeated, so that they are evenly spaced.
inline Block block_at(const QProduct& p, int nb, int rows, size_t row_bytes, size_t* srow,
                      std::vector<uint8_t>& pad) {
  for (int r = 0; r < 16; r++) {
    srow[r] = (size_t)(nb + std::min(r, rows - 1));
  }
  const uint8_t* first = p.W + (size_t)nb * row_bytes;
  if (rows < 16) {
    pad.resize(16 * row_bytes);
    for (int r = 0; r < 16; r++) {
      std::copy_n(first + std::min(r, rows - 1) * row_bytes, row_bytes, pad.data() + r * row_bytes);
    }
    first = pad.data();
  }
  Block k;
  for (int j = 0; j < 4; j++) {
    k.b[j] = first + 4 * j * row_bytes;
    k.s[j] = j * row_bytes;
  }
  return k;
}

// fn.template operator()<R>() for the compile-time R == rows (1 <= rows <= MAX): the row kernels
// take their rows of x as a template argument.
template <int MAX, typename F>
inline void with_rows(int rows, F&& fn) {
  if constexpr (MAX > 1) {
    if (rows < MAX) {
      with_rows<MAX - 1>(rows, fn);
      return;
    }
  }
  fn.template operator()<MAX>();
}

// Whether this build has the row kernels (cpu_q4rows.cpp with AVX-512 VNNI, cpu_q4rows_avx2.cpp
// without AVX-512), and the most rows of x they take: past it cpu_q4wide.cpp's kernel (5-8 rows,
// AVX-512 VNNI) or q8_chunk, whose rows then cost less (docs/cpu.md: "A row kernel for AVX2",
// "3-4 rows without transposes").
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool Q4_ROWS = VNNI;
constexpr int Q4_ROWS_MAX = 4;
#else
constexpr bool Q4_ROWS = true;
constexpr int Q4_ROWS_MAX = 8;
#endif

// Whether the row kernels run p (cpu_q4rows.cpp; never on a build without them), and x's dwords
// in their order, into xq.rows.
bool q4_rows_run(const QProduct& p);
void q4_rows_prepare(const QProduct& p, QuantizedX& xq);

// Rows [n0, n1) of y, for a product that q4_rows_run takes.
template <ScaleType T>
void q4_rows_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1);

// The row kernels' loop (q4_rows_chunk's, in cpu_q4rows.cpp or cpu_q4rows_avx2.cpp) over rows
// [n0, n1) of y for the MR == p.M rows of x: a 16-row block (block_at's Block k) at a time, its
// sums f[MR] (weight row r in lane r) from pass.template operator()<MR>(k, g, next, scale, bias, f)
// for every STEP-th group g, with the group's 16 lanes of the tables of scales and biases (filled
// every 16 groups: scale_tile's, or for 16-bit scales tiles(srow, groups, g, scale, bias), the
// kernel's one transpose for both) and `next`, the next block's distance (0 after a short one).
template <ScaleType T, int STEP, typename Tiles, typename Pass>
void q4_rows_blocks(const QProduct& p, int n0, int n1, Tiles&& tiles, Pass&& pass) {
  with_rows<Q4_ROWS_MAX>(p.M, [&]<int MR>() {
    const int groups = p.K / 64;
    const size_t row_bytes = (size_t)p.K / 2;
    alignas(64) float scale[16 * 16], bias[16 * 16];
    std::vector<uint8_t> pad;
    for (int nb = n0; nb < n1; nb += 16) {
      const int rows = std::min(16, n1 - nb);
      size_t srow[16];  // the scales' rows
      const Block k = block_at(p, nb, rows, row_bytes, srow, pad);
      const size_t next = rows == 16 ? 16 * row_bytes : 0;  // no block after a short one
      vf f[MR];
      for (int m = 0; m < MR; m++) {
        f[m] = zerof();
      }
      for (int g = 0; g < groups; g += STEP) {
        if (g % 16 == 0) {
          if constexpr (T == ScaleType::f32) {
            scale_tile<T>(p.scales, srow, groups, g, scale);
            scale_tile<T>(p.biases, srow, groups, g, bias);
          } else {
            tiles(srow, groups, g, scale, bias);
          }
        }
        pass.template operator()<MR>(k, g, next, scale + g % 16 * 16, bias + g % 16 * 16, f);
      }
      for (int m = 0; m < MR; m++) {
        alignas(64) float out[16];
        storef(out, f[m]);
        std::copy(out, out + rows, p.y + (size_t)m * p.N + nb);
      }
    }
  });
}

// Rows [n0, n1) (multiples of 16) of y for a product of repacked weights (cpu_q4packed.cpp),
// which every build with int8 products takes.
template <ScaleType T>
void q4_packed_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1);

// The same for the 3-8 row kernel (cpu_q4wide.cpp; it runs 5-8 where the row kernels run),
// which reads x in q8_chunk's order.
bool q4_wide_run(const QProduct& p);
template <ScaleType T>
void q4_wide_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1);

}  // namespace macspec::q8

#endif  // MACSPEC_INT8
