// 4-bit weights in groups of 64 repacked once, at load, for the int8 products (AVX-512 VNNI):
// each 16-row block's words transposed ahead of time, so that a vector holds one word (8 weights)
// of each of its 16 rows, as q8_chunk's and cpu_q4wide.cpp's transposes make them on the fly in
// every pass; and its scales and biases 16 rows to a group, as their scale tables do. A pass then
// reads one stream a thread with no shuffles: the transposes were about half of a 5-row pass's
// instructions (docs/cpu.md, "Weights repacked at load"). The integer sums are q8_chunk's exact
// numbers and the float steps the same, lane by lane, group by group in order: the same bits.
//
//   W (N, K / 8) uint32      -> (N / 16, K / 64, 128): [b][g][c * 16 + r] = W[16b + r][8g + c]
//   scales, biases (N, K / 64) -> (N / 16, K / 64, 16): [b][g][r] = S[16b + r][g]
// (products.py repacks with MLX's own transposes.)

#include <algorithm>
#include <stdexcept>

#include "common.h"
#include "qint8.h"

#if defined(MACSPEC_INT8)

namespace macspec::q8 {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

constexpr int MR_MAX = 8;  // rows of x a pass over a block keeps sums for (the registers hold 8)
constexpr int AHEAD = 4;  // groups prefetched ahead (2.3 KB; further ahead measured slower)

// Rows [m0, m0 + MR) of y's block b (16 rows at 16b) for x's rows of the same numbers.
template <ScaleType T, int MR>
void block_rows(const QProduct& p, const QuantizedX& xq, int b, int m0) {
  using E = scale_elem<T>;
  const int groups = p.K / 64, M = xq.M;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p.W) + (size_t)b * groups * 128;
  const E* s = static_cast<const E*>(p.scales) + (size_t)b * groups * 16;
  const E* bs = static_cast<const E*>(p.biases) + (size_t)b * groups * 16;
  constexpr int CH = MR <= 2 ? 2 : 1;  // independent sums a row: ~10 products under way
  vf facc[MR];
  for (int m = 0; m < MR; m++) {
    facc[m] = {_mm512_setzero_ps()};
  }
  for (int g = 0; g < groups; g++, w += 128) {
    for (int l = 0; l < 8; l++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + AHEAD * 128 + 16 * l), _MM_HINT_T0);
    }
    _mm_prefetch(reinterpret_cast<const char*>(s + (g + 4 * AHEAD) * 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bs + (g + 4 * AHEAD) * 16), _MM_HINT_T0);
    vi acc[MR][2 * CH];
    for (int m = 0; m < MR; m++) {
      for (int c = 0; c < 2 * CH; c++) {
        acc[m][c] = zero();
      }
    }
    const int32_t* x = xq.q.data() + (size_t)g * 16 * M + m0;  // dword v of row m: x[v * M + m]
    for (int c = 0; c < 8; c++) {
      const vi v = {_mm512_loadu_si512(w + c * 16)};
      const vi lo = nibbles_lo(v), hi = nibbles_hi(v);
      const int k = CH == 2 ? 2 * (c & 1) : 0;
      for (int m = 0; m < MR; m++) {
        acc[m][k] = dot(acc[m][k], lo, x + 2 * c * M + m);
        acc[m][k + 1] = dot(acc[m][k + 1], hi, x + (2 * c + 1) * M + m);
      }
    }
    const vf scale = load_scales(s + g * 16, 16), bias = load_scales(bs + g * 16, 16);
    for (int m = 0; m < MR; m++) {
      vi sum = add(acc[m][0], acc[m][1]);
      if constexpr (CH == 2) {
        sum = add(sum, add(acc[m][2], acc[m][3]));
      }
      const size_t i = (size_t)g * M + m0 + m;
      facc[m] = accumulate(facc[m], sum, scale, xq.d[i], bias, xq.ds[i]);
    }
  }
  for (int m = 0; m < MR; m++) {
    _mm512_storeu_ps(p.y + (size_t)(m0 + m) * p.N + 16 * b, facc[m].v);
  }
}

}  // namespace

template <ScaleType T>
void q4_packed_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  for (int b = n0 / 16; b < n1 / 16; b++) {
    for (int m0 = 0; m0 < p.M; m0 += MR_MAX) {
      with_rows<MR_MAX>(std::min(MR_MAX, p.M - m0),
                        [&]<int MR>() { block_rows<T, MR>(p, xq, b, m0); });
    }
  }
}

bool q4_packs() {
  return true;
}

#else  // no AVX-512 VNNI: nothing is repacked (q4_packs), and a repacked product is refused

template <ScaleType T>
void q4_packed_chunk(const QProduct&, const QuantizedX&, int, int) {
  throw std::logic_error("[macspec products] repacked weights on a build without AVX-512 VNNI");
}

bool q4_packs() {
  return false;
}

#endif

template void q4_packed_chunk<ScaleType::f32>(const QProduct&, const QuantizedX&, int, int);
template void q4_packed_chunk<ScaleType::f16>(const QProduct&, const QuantizedX&, int, int);
template void q4_packed_chunk<ScaleType::bf16>(const QProduct&, const QuantizedX&, int, int);

}  // namespace macspec::q8

#endif  // MACSPEC_INT8

namespace macspec {

bool q4_packs() {
#if defined(MACSPEC_INT8)
  return q8::q4_packs();
#else
  return false;
#endif
}

}  // namespace macspec
