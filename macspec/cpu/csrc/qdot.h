// The integer steps of the int8 products (cpu_qint8.cpp) on 16 lanes, one per weight row: one
// AVX-512 register, or two AVX2 registers holding rows 0-7 and 8-15. Each lane's arithmetic is
// the same on every instruction set (integer sums are exact; the float steps are the same
// roundings, FMAs included), so every build gives the same bits.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#define MACSPEC_INT8 1

namespace macspec::q8 {

// Where the rows of a 16-row weight block lie: row 4k + j at b[k] + s[j], from 8 registers, and
// the loads' offsets from there fixed at compile time. (GCC kept an array of 16 row pointers in
// vector registers and took each one out for its load: about as many vector instructions as the
// dot products.)
struct Block {
  const uint8_t* b[4];
  size_t s[4];
  const uint8_t* row(int r) const {
    return b[r / 4] + s[r % 4];
  }
  // In a short loop GCC hoists the 16 sums b[k] + s[j] out of it, more than the registers hold
  // (the same extractions again): this makes b opaque, so that each load adds them itself.
  void keep_apart() {
    asm("" : "+r"(b[0]), "+r"(b[1]), "+r"(b[2]), "+r"(b[3]));
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)

// vpdpbusd: each lane += the dot product of 4 unsigned weight bytes and 4 signed x bytes.
#if defined(__AVX512VNNI__)
constexpr bool VNNI = true;
constexpr const char* ISA = "avx512-vnni";
#else
constexpr bool VNNI = false;
constexpr const char* ISA = "avx512bw";
#endif
constexpr int MB_MAX = 16;  // x rows per pass over the unpacked weights: 16 accumulators

struct vi {
  __m512i v;
};
struct vf {
  __m512 v;
};

static inline vi zero() {
  return {_mm512_setzero_si512()};
}
static inline vf zerof() {
  return {_mm512_setzero_ps()};
}
static inline vi load(const uint32_t* p) {  // 64-byte aligned
  return {_mm512_load_si512(p)};
}
static inline void store(uint32_t* p, vi a) {
  _mm512_store_si512(p, a.v);
}
static inline vi nibbles_lo(vi a) {
  return {_mm512_and_si512(a.v, _mm512_set1_epi8(15))};
}
static inline vi nibbles_hi(vi a) {
  return {_mm512_and_si512(_mm512_srli_epi32(a.v, 4), _mm512_set1_epi8(15))};
}
static inline vi flip_sign(vi a) {  // q - 128 as a signed byte
  return {_mm512_xor_si512(a.v, _mm512_set1_epi8(-128))};
}
static inline vi add(vi a, int32_t c) {
  return {_mm512_add_epi32(a.v, _mm512_set1_epi32(c))};
}
static inline vi add(vi a, vi b) {
  return {_mm512_add_epi32(a.v, b.v)};
}

// acc += w . x per lane, x the 4 bytes at p; w's bytes unsigned and small enough that pairs of
// products fit int16 where there is no VNNI (4-bit weights, or any with VNNI).
static inline vi dot(vi acc, vi w, const int32_t* p) {
#if defined(__AVX512VNNI__)
  // By hand: GCC copies the accumulator around the intrinsic (two moves a product), and this
  // reads x as a broadcast operand.
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(w.v), "m"(*p));
  return acc;
#else
  __m512i pairs = _mm512_maddubs_epi16(w.v, _mm512_set1_epi32(*p));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
#endif
}

// Signed 8-bit weights s = q - 128 without VNNI: |s| (at most 128) times x with s's sign
// (at most 127 in size): pairs of products stay below 2^15, so maddubs cannot saturate.
struct signed_w {
  __m512i abs;
  __mmask64 negative;
};
static inline signed_w prepare(vi s) {
  return {_mm512_abs_epi8(s.v), _mm512_movepi8_mask(s.v)};
}
static inline vi dot(vi acc, const signed_w& w, const int32_t* p) {
  const __m512i b = _mm512_set1_epi32(*p);
  const __m512i sx = _mm512_mask_sub_epi8(b, w.negative, _mm512_setzero_si512(), b);
  __m512i pairs = _mm512_maddubs_epi16(w.abs, sx);
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}

// Without VNNI, 4-bit weights: pairs of products (at most 2 * 15 * 127) summed 8 at a time in
// int16 lanes before widening, a third fewer instructions than widening each.
struct vs {
  __m512i v;
};
static inline vs zero16() {
  return {_mm512_setzero_si512()};
}
static inline vs dot16(vs acc, vi w, const int32_t* p) {
  return {_mm512_add_epi16(acc.v, _mm512_maddubs_epi16(w.v, _mm512_set1_epi32(*p)))};
}
static inline vi widen(vi acc, vs s) {
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(s.v, _mm512_set1_epi16(1)))};
}

static inline vf loadf(const float* p) {
  return {_mm512_load_ps(p)};
}
static inline void storef(float* p, vf a) {
  _mm512_store_ps(p, a.v);
}
// f + float(acc) * (scale * d) + bias * xs, lane by lane, in that order.
static inline vf accumulate(vf f, vi acc, vf scale, float d, vf bias, float xs) {
  const __m512 sd = _mm512_mul_ps(scale.v, _mm512_set1_ps(d));
  const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc.v), sd, f.v);
  return {_mm512_fmadd_ps(bias.v, _mm512_set1_ps(xs), t)};
}

// z[j] holding 16 bytes of rows j, 4 + j, 8 + j, 12 + j in its quarters, as 4 vectors: out[c]
// lane r = bytes 4c..4c+3 of row r.
static inline void interleave_quarters(const __m512i* z, vi* out) {
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = {_mm512_unpacklo_epi64(t0, t2)};
  out[1] = {_mm512_unpackhi_epi64(t0, t2)};
  out[2] = {_mm512_unpacklo_epi64(t1, t3)};
  out[3] = {_mm512_unpackhi_epi64(t1, t3)};
}

// 16 bytes at `at` of the block's rows as 4 vectors: out[c] lane r = bytes 4c..4c+3 of row r.
static inline void transpose(const Block& k, size_t at, vi* out) {
  __m512i z[4];
  for (int j = 0; j < 4; j++) {  // z[j] = rows j, 4 + j, 8 + j, 12 + j in its four quarters
    __m512i t = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(k.row(j) + at)));
    for (int i = 1; i < 4; i++) {
      t = _mm512_inserti32x4(t, _mm_loadu_si128((const __m128i*)(k.row(4 * i + j) + at)), i);
    }
    z[j] = t;
  }
  interleave_quarters(z, out);
}

// 16 values of a scale or bias array at p (n of them; the rest read as 0) as floats.
template <typename T>
static inline vf load_scales(const T* p, int n) {
  const __mmask16 k = (__mmask16)((1u << n) - 1);
  if constexpr (sizeof(T) == 4) {
    return {_mm512_maskz_loadu_ps(k, p)};
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    if constexpr (T::bf16) {  // the top half of a float32
      return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
    } else {
      return {_mm512_cvtph_ps(h)};
    }
  }
}

// r[i] lane j becomes r[j] lane i.
static inline void transpose(vf* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i].v, r[i + 1].v);
    t[i + 1] = _mm512_unpackhi_ps(r[i].v, r[i + 1].v);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k] quarter q: lane 4q + k of r[i..i+3]
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int k = 0; k < 4; k++) {
    const __m512 a = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44);
    const __m512 b = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xee);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
    const __m512 d = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xee);
    r[k] = {_mm512_shuffle_f32x4(a, c, 0x88)};
    r[4 + k] = {_mm512_shuffle_f32x4(a, c, 0xdd)};
    r[8 + k] = {_mm512_shuffle_f32x4(b, d, 0x88)};
    r[12 + k] = {_mm512_shuffle_f32x4(b, d, 0xdd)};
  }
}

#else  // AVX2: rows 0-7 in `lo`, 8-15 in `hi`

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool VNNI = true;
constexpr const char* ISA = "avx-vnni";
#else
constexpr bool VNNI = false;
constexpr const char* ISA = "avx2";
#endif
constexpr int MB_MAX = 4;  // two registers an accumulator: 4 of them fit 16 registers

struct vi {
  __m256i lo, hi;
};
struct vf {
  __m256 lo, hi;
};

static inline vi zero() {
  return {_mm256_setzero_si256(), _mm256_setzero_si256()};
}
static inline vf zerof() {
  return {_mm256_setzero_ps(), _mm256_setzero_ps()};
}
static inline vi load(const uint32_t* p) {
  return {_mm256_load_si256((const __m256i*)p), _mm256_load_si256((const __m256i*)(p + 8))};
}
static inline void store(uint32_t* p, vi a) {
  _mm256_store_si256((__m256i*)p, a.lo);
  _mm256_store_si256((__m256i*)(p + 8), a.hi);
}
static inline vi nibbles_lo(vi a) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
static inline vi nibbles_hi(vi a) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi32(a.lo, 4), m),
          _mm256_and_si256(_mm256_srli_epi32(a.hi, 4), m)};
}
static inline vi flip_sign(vi a) {
  const __m256i m = _mm256_set1_epi8(-128);
  return {_mm256_xor_si256(a.lo, m), _mm256_xor_si256(a.hi, m)};
}
static inline vi add(vi a, int32_t c) {
  const __m256i b = _mm256_set1_epi32(c);
  return {_mm256_add_epi32(a.lo, b), _mm256_add_epi32(a.hi, b)};
}
static inline vi add(vi a, vi b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}

static inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#else
  const __m256i pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline vi dot(vi acc, vi w, const int32_t* p) {
  const __m256i b = _mm256_set1_epi32(*p);
  return {dot8(acc.lo, w.lo, b), dot8(acc.hi, w.hi, b)};
}

struct signed_w {  // as the AVX-512 one: |s| and s, whose sign x takes
  __m256i abs_lo, abs_hi, lo, hi;
};
static inline signed_w prepare(vi s) {
  return {_mm256_abs_epi8(s.lo), _mm256_abs_epi8(s.hi), s.lo, s.hi};
}
static inline vi dot(vi acc, const signed_w& w, const int32_t* p) {
  const __m256i b = _mm256_set1_epi32(*p), one = _mm256_set1_epi16(1);
  const __m256i lo = _mm256_maddubs_epi16(w.abs_lo, _mm256_sign_epi8(b, w.lo));
  const __m256i hi = _mm256_maddubs_epi16(w.abs_hi, _mm256_sign_epi8(b, w.hi));
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(lo, one)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(hi, one))};
}

struct vs {
  __m256i lo, hi;
};
static inline vs zero16() {
  return {_mm256_setzero_si256(), _mm256_setzero_si256()};
}
static inline vs dot16(vs acc, vi w, const int32_t* p) {
  const __m256i b = _mm256_set1_epi32(*p);
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, b)),
          _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, b))};
}
static inline vi widen(vi acc, vs s) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(s.lo, one)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(s.hi, one))};
}

static inline vf loadf(const float* p) {
  return {_mm256_load_ps(p), _mm256_load_ps(p + 8)};
}
static inline void storef(float* p, vf a) {
  _mm256_store_ps(p, a.lo);
  _mm256_store_ps(p + 8, a.hi);
}
static inline vf accumulate(vf f, vi acc, vf scale, float d, vf bias, float xs) {
  const __m256 dv = _mm256_set1_ps(d), xv = _mm256_set1_ps(xs);
  const __m256 lo = _mm256_fmadd_ps(
      _mm256_cvtepi32_ps(acc.lo), _mm256_mul_ps(scale.lo, dv), f.lo);
  const __m256 hi = _mm256_fmadd_ps(
      _mm256_cvtepi32_ps(acc.hi), _mm256_mul_ps(scale.hi, dv), f.hi);
  return {_mm256_fmadd_ps(bias.lo, xv, lo), _mm256_fmadd_ps(bias.hi, xv, hi)};
}

// Rows r0..r0+7 of the block as the AVX-512 transpose lays out 16 rows.
static inline void transpose8(const Block& k, int r0, size_t at, __m256i* out) {
  __m256i z[4];
  for (int j = 0; j < 4; j++) {  // z[j] = rows j, 4 + j in its two halves
    const __m128i a = _mm_loadu_si128((const __m128i*)(k.row(r0 + j) + at));
    z[j] = _mm256_inserti128_si256(
        _mm256_castsi128_si256(a), _mm_loadu_si128((const __m128i*)(k.row(r0 + 4 + j) + at)), 1);
  }
  const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}
static inline void transpose(const Block& k, size_t at, vi* out) {
  __m256i lo[4], hi[4];
  transpose8(k, 0, at, lo);
  transpose8(k, 8, at, hi);
  for (int c = 0; c < 4; c++) {
    out[c] = {lo[c], hi[c]};
  }
}

template <typename T>
static inline vf load_scales(const T* p, int n) {
  alignas(32) T v[16] = {};
  if (n < 16) {  // a tile's last groups; else loaded in place (a memcpy of n is a library call)
    std::memcpy(v, p, sizeof(T) * n);
    p = v;
  }
  if constexpr (sizeof(T) == 4) {
    return {_mm256_loadu_ps((const float*)p), _mm256_loadu_ps((const float*)p + 8)};
  } else {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    const __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
    if constexpr (T::bf16) {
      return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
              _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
    } else {
      return {_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi)};
    }
  }
}

static inline void transpose8(__m256* r) {  // r[i] lane j becomes r[j] lane i
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int k = 0; k < 4; k++) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// As the AVX-512 transpose, in four 8 x 8 blocks.
static inline void transpose(vf* r) {
  __m256 b[4][8];  // [rows 0-7 / 8-15][lanes 0-7 / 8-15]
  for (int i = 0; i < 8; i++) {
    b[0][i] = r[i].lo;
    b[1][i] = r[i].hi;
    b[2][i] = r[8 + i].lo;
    b[3][i] = r[8 + i].hi;
  }
  for (auto& block : b) {
    transpose8(block);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = {b[0][i], b[2][i]};
    r[8 + i] = {b[1][i], b[3][i]};
  }
}

#endif

}  // namespace macspec::q8

#endif  // __AVX2__
