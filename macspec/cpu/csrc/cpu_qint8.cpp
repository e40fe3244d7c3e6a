// Quantized products with int8 activations, as llama.cpp computes its batched quantized products
// on CPUs: x quantized per weight group to int8 with a float scale, integer dot products of the
// unsigned weights with them (vpdpbusd, or vpmaddubsw + vpmaddwd), then per group
//   y += float(sum q * xq) * (scale * d) + bias * (d * sum xq),
// the product of the weights with x as quantized. The float path unpacked every weight to float
// and did one FMA per weight and row: past two rows it was bound by compute, not memory.
//
// Weights stay in MLX's layout (no repacked copy beside the model's): each 16-byte piece of 16
// rows is transposed on the fly so that a vector holds 4 weights of each row, one row a lane,
// into a small buffer that every row of x then reads. Each lane's sums are exact integers and its
// float steps are the same whatever M, the threads or the instruction set. A pass of up to 8
// rows by 4-bit weights in groups of 64 runs cpu_q4rows.cpp's kernel (1-4 rows) or
// cpu_q4wide.cpp's (5-8) instead with AVX-512 VNNI, and cpu_q4rows_avx2.cpp's (1-8) on AVX2.
// 4-bit weights repacked at load (products.repack) run cpu_q4packed.cpp's at any number of rows.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "qint8.h"

namespace macspec {

#if defined(MACSPEC_INT8)

using namespace q8;

const char* int8_isa() {
  return ISA;
}

namespace {

constexpr int SLAB = 256;  // columns of 16 rows unpacked at a time (4-8 KB, in L1)
constexpr int MSUPER = 64;  // rows of x whose float sums are kept at a time

#if defined(__AVX512F__) && defined(__AVX512BW__)
// quantize_group's loops on 16 lanes (G a multiple of 16), the same values: vcvtps2dq rounds in
// the rounding mode as nearbyint does. A pass of 5-8 rows spent a large share of its time in the
// scalar loops, on one core while the others waited (docs/cpu.md, "Each thread its own stretch of rows").
uint32_t top_bits(const float* x, int G) {
  __m512i top = _mm512_setzero_si512();
  for (int k = 0; k < G; k += 16) {
    const __m512i bits = _mm512_loadu_si512(x + k);
    top = _mm512_max_epu32(top, _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)));
  }
  return _mm512_reduce_max_epu32(top);
}

int round_group(const float* x, int G, float inv, bool nibble_order, int8_t* out) {
  // Within 8 bytes the even columns, then the odd ones: the order 4-bit weights unpack in.
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  __m512i sum = _mm512_setzero_si512();
  for (int k = 0; k < G; k += 16) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(inv)));
    q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    sum = _mm512_add_epi32(sum, q);
    __m128i bytes = _mm512_cvtepi32_epi8(q);
    if (nibble_order) {
      bytes = _mm_shuffle_epi8(bytes, order);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), bytes);
  }
  return _mm512_reduce_add_epi32(sum);
}
#else
uint32_t top_bits(const float* x, int G) {
  uint32_t top = 0;  // max |x| as bits: they order as the values do (a form GCC vectorizes)
  for (int k = 0; k < G; k++) {
    uint32_t bits;
    std::memcpy(&bits, x + k, 4);
    top = std::max(top, bits & 0x7fffffffu);
  }
  return top;
}

int round_group(const float* x, int G, float inv, bool nibble_order, int8_t* out) {
  int8_t q[128];
  int8_t* dst = nibble_order ? q : out;  // reordered below
  int s = 0;
  for (int k = 0; k < G; k++) {
    const float v = std::nearbyint(x[k] * inv);  // the rounding mode's: to nearest even
    dst[k] = (int8_t)std::clamp(v, -127.0f, 127.0f);
    s += dst[k];
  }
  if (nibble_order) {  // per 32 columns, as the nibbles unpack: for c < 4, 8c + (0 2 4 6 1 3 5 7)
    for (int u = 0; u < G; u += 32) {
      for (int c = 0; c < 32; c += 8) {
        for (int j = 0; j < 4; j++) {
          out[u + c + j] = q[u + c + 2 * j];
          out[u + c + 4 + j] = q[u + c + 2 * j + 1];
        }
      }
    }
  }
  return s;
}
#endif

// One group of one row. A row holding inf or NaN gets a NaN scale, so that its results are NaN
// as the float products' would be.
void quantize_group(const float* x, int G, int bits, int8_t* out, float* d, float* ds, int* sum) {
  const uint32_t top = top_bits(x, G);
  const bool finite = top < 0x7f800000u;
  float amax;
  std::memcpy(&amax, &top, 4);
  const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
  const int s = round_group(x, G, inv, bits == 4, out);
  *d = finite ? amax / 127.0f : NAN;
  *ds = *d * (float)s;
  *sum = s;
}

void quantize_x(const QProduct& p, QuantizedX& xq) {
  const int M = p.M, G = p.group, groups = p.K / G;
  xq.M = M;
  xq.q.resize((size_t)p.K / 4 * M);
  xq.d.resize((size_t)groups * M);
  xq.ds.resize(xq.d.size());
  xq.sum.resize(xq.d.size());
  int32_t words[32];
  for (int m = 0; m < M; m++) {
    for (int g = 0; g < groups; g++) {
      const size_t i = (size_t)g * M + m;
      int8_t* bytes = reinterpret_cast<int8_t*>(words);
      quantize_group(p.x + (size_t)m * p.K + (size_t)g * G, G, p.bits, bytes, &xq.d[i],
                     &xq.ds[i], &xq.sum[i]);
      for (int v = 0; v < G / 4; v++) {
        xq.q[((size_t)g * G / 4 + v) * M + m] = words[v];
      }
    }
  }
}

// Columns [at, at + bytes) of 16 rows, as vectors of 4 weights a row (4 bits: 8 vectors per
// 16 bytes, low nibbles then high ones; 8 bits: 4 vectors, as q - 128 where there is no VNNI).
template <int BITS>
void unpack(Block k, size_t at, size_t bytes, uint32_t* buf) {
  for (size_t b = 0; b < bytes; b += 64) {  // the slab after next, 16 streams for the prefetcher
    k.keep_apart();
    for (int r = 0; r < 16; r++) {
      __builtin_prefetch(k.row(r) + at + b + 2 * SLAB * BITS / 8);
    }
  }
  for (size_t b = 0; b < bytes; b += 16) {
    vi t[4];
    k.keep_apart();
    transpose(k, at + b, t);
    for (int c = 0; c < 4; c++) {
      if constexpr (BITS == 4) {
        store(buf, nibbles_lo(t[c]));
        store(buf + 16, nibbles_hi(t[c]));
        buf += 32;
      } else {
        store(buf, VNNI ? t[c] : flip_sign(t[c]));
        buf += 16;
      }
    }
  }
}

// What one pass over an unpacked slab needs, for rows of x from m0.
struct Slab {
  const uint32_t* buf;  // (groups * G / 4) vectors of 16 lanes
  const float* scale;  // groups * 16
  const float* bias;
  int g0, groups, G, all_groups;
};

// Independent sums per row of x: a product waits ~5 cycles for the one before it on the same
// sum, and about 10 must be under way to keep the units busy. Integer sums are exact: how a group
// is split changes no result.
template <int MB>
constexpr int CHAINS = MB >= 8 ? 1 : MB >= 4 ? 2 : MB >= 2 ? 4 : 8;

// acc[m][c] += the group's integer sums, vector v on sum v % CH.
template <int BITS, int MB, int CH>
inline void sums32(const uint32_t* wv, int VG, const int32_t* x, int M, vi (*acc)[CH]) {
  for (int v = 0; v < VG; v += CH) {
    for (int c = 0; c < CH; c++, x += M) {
      const vi w = load(wv + (v + c) * 16);
      if constexpr (BITS == 8 && !VNNI) {
        const signed_w sw = prepare(w);
        for (int m = 0; m < MB; m++) {
          acc[m][c] = dot(acc[m][c], sw, x + m);
        }
      } else {
        for (int m = 0; m < MB; m++) {
          acc[m][c] = dot(acc[m][c], w, x + m);
        }
      }
    }
  }
}

// The same for 4-bit weights without VNNI: 8 vectors at a time in int16 (qdot.h's dot16).
template <int MB, int CH>
inline void sums16(const uint32_t* wv, int VG, const int32_t* x, int M, vi (*acc)[CH]) {
  for (int v = 0; v < VG; v += 8) {
    vs s[MB];
    for (int m = 0; m < MB; m++) {
      s[m] = zero16();
    }
    // Not unrolled: GCC then computes every product first and keeps them on the stack.
#pragma GCC unroll 1
    for (int c = 0; c < 8; c++, x += M) {
      const vi w = load(wv + (v + c) * 16);
      for (int m = 0; m < MB; m++) {
        s[m] = dot16(s[m], w, x + m);
      }
    }
    for (int m = 0; m < MB; m++) {
      acc[m][0] = widen(acc[m][0], s[m]);
    }
  }
}

// facc[m] (16 lanes) += the slab's part of rows m0..m0+MB of y, group by group.
template <int BITS, int MB>
void rows_pass(const Slab& s, const QuantizedX& xq, int m0, float* facc) {
  constexpr int CH = BITS == 4 && !VNNI ? 1 : CHAINS<MB>;  // divides every G / 4: 8, 16, 32
  const int VG = s.G / 4, M = xq.M;  // vectors per group; x's dword stride
  for (int j = 0; j < s.groups; j++) {
    const int g = s.g0 + j;
    vi acc[MB][CH];
    for (int m = 0; m < MB; m++) {
      for (int c = 0; c < CH; c++) {
        acc[m][c] = zero();
      }
    }
    const uint32_t* wv = s.buf + (size_t)j * VG * 16;
    const int32_t* x = xq.q.data() + (size_t)g * VG * M + m0;  // x dword v of row m: x[v * M + m]
    if constexpr (BITS == 4 && !VNNI) {
      sums16<MB>(wv, VG, x, M, acc);
    } else {
      sums32<BITS, MB, CH>(wv, VG, x, M, acc);
    }
    const vf scale = loadf(s.scale + j * 16), bias = loadf(s.bias + j * 16);
    const size_t at = (size_t)g * M + m0;
    for (int m = 0; m < MB; m++) {
      for (int c = 1; c < CH; c++) {
        acc[m][0] = add(acc[m][0], acc[m][c]);
      }
      if constexpr (BITS == 8 && !VNNI) {
        acc[m][0] = add(acc[m][0], 128 * xq.sum[at + m]);  // sum (q - 128) x + 128 sum x
      }
      const vf f = loadf(facc + m * 16);
      storef(facc + m * 16, accumulate(f, acc[m][0], scale, xq.d[at + m], bias, xq.ds[at + m]));
    }
  }
}

// Rows [n0, n1) of y for every row of x.
template <int BITS, ScaleType T>
void q8_chunk(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  const int G = p.group, groups = p.K / G, slab_groups = SLAB / G;  // 2, 4 or 8: divides 16
  const size_t row_bytes = (size_t)p.K * BITS / 8;
  alignas(64) uint32_t buf[SLAB / 4 * 16];
  alignas(64) float scale[16 * 16], bias[16 * 16], facc[MSUPER * 16];
  std::vector<uint8_t> pad;
  for (int nb = n0; nb < n1; nb += 16) {
    const int rows = std::min(16, n1 - nb);
    size_t srow[16];  // the scales' rows
    const Block k = block_at(p, nb, rows, row_bytes, srow, pad);
    for (int m0 = 0; m0 < p.M; m0 += MSUPER) {
      const int mc = std::min(MSUPER, p.M - m0);
      std::fill(facc, facc + mc * 16, 0.0f);
      for (int g0 = 0; g0 < groups; g0 += slab_groups) {
        const int gc = std::min(slab_groups, groups - g0);
        unpack<BITS>(k, (size_t)g0 * G * BITS / 8, (size_t)gc * G * BITS / 8, buf);
        if (g0 % 16 == 0) {
          scale_tile<T>(p.scales, srow, groups, g0, scale);
          scale_tile<T>(p.biases, srow, groups, g0, bias);
        }
        const Slab s{buf, scale + g0 % 16 * 16, bias + g0 % 16 * 16, g0, gc, G, groups};
        for (int m = 0; m < mc; m += MB_MAX) {
          const int mr = std::min(MB_MAX, mc - m);
          float* fm = facc + m * 16;
          with_rows<MB_MAX>(mr, [&]<int MB>() { rows_pass<BITS, MB>(s, xq, m0 + m, fm); });
        }
      }
      for (int m = 0; m < mc; m++) {
        std::copy(facc + m * 16, facc + m * 16 + rows, p.y + (size_t)(m0 + m) * p.N + nb);
      }
    }
  }
}

template <ScaleType T>
void q8_chunk_bits(const QProduct& p, const QuantizedX& xq, int n0, int n1) {
  if (p.packed) {
    q4_packed_chunk<T>(p, xq, n0, n1);
    return;
  }
  if constexpr (Q4_ROWS) {  // (xq.rows is empty on a build without row kernels)
    if (!xq.rows.empty()) {
      q4_rows_chunk<T>(p, xq, n0, n1);
      return;
    }
  }
  if (q4_wide_run(p)) {
    q4_wide_chunk<T>(p, xq, n0, n1);
    return;
  }
  if (p.bits == 4) {
    q8_chunk<4, T>(p, xq, n0, n1);
  } else {
    q8_chunk<8, T>(p, xq, n0, n1);
  }
}

}  // namespace

void q_int8_products(const QProduct* ps, int count) {
  if (count < 1 || count > MAX_JOINED) {
    throw std::invalid_argument("[macspec products] 1 to 4 quantized products in one job");
  }
  QuantizedX xqs[MAX_JOINED];
  const QuantizedX* xq[MAX_JOINED];
  int N[MAX_JOINED], row_bytes[MAX_JOINED];
  for (int j = 0; j < count; j++) {
    const QProduct& p = ps[j];
    if (j > 0 && same_x(ps[j - 1], p)) {
      xq[j] = xq[j - 1];
    } else {
      quantize_x(p, xqs[j]);
      if (q4_rows_run(p)) {
        q4_rows_prepare(p, xqs[j]);
      }
      xq[j] = &xqs[j];
    }
    N[j] = p.N;
    row_bytes[j] = p.K * p.bits / 8;
  }
  run_joined(N, row_bytes, count, [&](int j, int n0, int n1) {
    switch (ps[j].type) {
      case ScaleType::f32: q8_chunk_bits<ScaleType::f32>(ps[j], *xq[j], n0, n1); break;
      case ScaleType::f16: q8_chunk_bits<ScaleType::f16>(ps[j], *xq[j], n0, n1); break;
      case ScaleType::i8: q4_packed_chunk<ScaleType::i8>(ps[j], *xq[j], n0, n1); break;
      default: q8_chunk_bits<ScaleType::bf16>(ps[j], *xq[j], n0, n1); break;
    }
  });
}

#else  // no integer dot products on this CPU: the float products run instead

const char* int8_isa() {
  return nullptr;
}

void q_int8_products(const QProduct* products, int count) {
  q_float_products(products, count);
}

#endif

}  // namespace macspec
