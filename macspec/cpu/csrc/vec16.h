// The 16-lane float vectors the products (cpu_linear.cpp) are written in: one AVX-512 register,
// or two AVX2 registers with the same lanes summed in the same order, and their sums.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace macspec {

constexpr int L = 16;  // lanes of one vector (two registers with AVX2, one with AVX-512)

// How many such vectors the register file holds. The blocks below keep their accumulators, the
// weight vectors and one x vector in registers; past this they spill to the stack on every
// step (AVX2 with AVX-512's blocks ran slower than BLAS: docs/cpu.md).
#if defined(__AVX512F__)
constexpr int VREGS = 32;
#elif defined(__AVX__) || defined(__aarch64__)
constexpr int VREGS = 8;
#else
constexpr int VREGS = 4;
#endif

// Weight rows per block for MB rows of x: the most that fits `per_row` accumulators of each x
// row and `weights` vectors of each weight row, beside one x vector (at least 1).
constexpr int rows_fitting(int MB, int per_row, int weights) {
  int R = 4;
  while (R > 1 && per_row * MB * R + weights * R + 1 > VREGS) {
    R--;
  }
  return R;
}
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf loadf(const float* p) {
  return *(const vfu*)p;
}

static inline vf to_vf(vi v) {
  return __builtin_convertvector(v, vf);
}

// 16 bytes widened to 16 int32 lanes (GCC turns __builtin_convertvector into byte-by-byte
// inserts here, several times slower than the one instruction).
static inline vi widen16(const uint8_t* p) {
  vi r;
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

// Keeps a loaded vector in a register: without it GCC reloads each weight vector once per row
// of x (and each row of x once per weight row) instead of once.
static inline void pin(vf& v) {
  asm("" : "+v"(v));
}

// One level of hsums(): lanes i and i + w of every vector added, two vectors packed into one.
template <int W>
static inline vf fold(vf a, vf b) {
  if constexpr (W == 8) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  } else if constexpr (W == 4) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
        __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  } else if constexpr (W == 2) {
    return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
        __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  } else {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
        __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
}
#else
// Without AVX-512 GCC keeps 64-byte vectors on the stack and moves every step through memory
// (AVX2 ran a 2-row product slower than BLAS): the 16 lanes are two 8-lane halves here,
// with the same lanes in the same order, so every sum is taken as with AVX-512.
typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));

struct vf {
  f8 lo, hi;
  friend vf operator+(vf a, vf b) {
    return {a.lo + b.lo, a.hi + b.hi};
  }
  friend vf operator*(vf a, vf b) {
    return {a.lo * b.lo, a.hi * b.hi};
  }
  friend vf operator*(vf a, float s) {
    return {a.lo * s, a.hi * s};
  }
  vf& operator+=(vf b) {
    lo += b.lo;
    hi += b.hi;
    return *this;
  }
};

struct vi {
  i8 lo, hi;
  friend vi operator&(vi a, int b) {
    return {a.lo & b, a.hi & b};
  }
  friend vi operator>>(vi a, int b) {
    return {a.lo >> b, a.hi >> b};
  }
};

static inline vf loadf(const float* p) {
  return {*(const f8u*)p, *(const f8u*)(p + 8)};
}

static inline vf to_vf(vi v) {
  return {__builtin_convertvector(v.lo, f8), __builtin_convertvector(v.hi, f8)};
}

// 16 bytes widened to 16 int32 lanes.
static inline vi widen16(const uint8_t* p) {
  vi r;
#if defined(__AVX2__)
  __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  std::memcpy(&r.lo, &a, sizeof(a));
  std::memcpy(&r.hi, &b, sizeof(b));
#else
  for (int i = 0; i < 8; i++) {
    r.lo[i] = p[i];
    r.hi[i] = p[i + 8];
  }
#endif
  return r;
}

// Keeps a loaded vector in registers (see the AVX-512 pin).
static inline void pin(vf& v) {
#if defined(__AVX__) && defined(__GNUC__)
  asm("" : "+x"(v.lo), "+x"(v.hi));
#endif
}

// Lanes I of the 16 lanes (lo, hi), as 8 lanes.
template <int... I>
static inline f8 pick(vf a) {
  return __builtin_shufflevector(a.lo, a.hi, I...);
}

// One level of hsums(), as the AVX-512 fold: a's folded lanes, then b's.
template <int W>
static inline vf fold(vf a, vf b) {
  if constexpr (W == 8) {
    return {a.lo + a.hi, b.lo + b.hi};
  } else if constexpr (W == 4) {
    return {pick<0, 1, 2, 3, 8, 9, 10, 11>(a) + pick<4, 5, 6, 7, 12, 13, 14, 15>(a),
            pick<0, 1, 2, 3, 8, 9, 10, 11>(b) + pick<4, 5, 6, 7, 12, 13, 14, 15>(b)};
  } else if constexpr (W == 2) {
    return {pick<0, 1, 4, 5, 8, 9, 12, 13>(a) + pick<2, 3, 6, 7, 10, 11, 14, 15>(a),
            pick<0, 1, 4, 5, 8, 9, 12, 13>(b) + pick<2, 3, 6, 7, 10, 11, 14, 15>(b)};
  } else {
    return {pick<0, 2, 4, 6, 8, 10, 12, 14>(a) + pick<1, 3, 5, 7, 9, 11, 13, 15>(a),
            pick<0, 2, 4, 6, 8, 10, 12, 14>(b) + pick<1, 3, 5, 7, 9, 11, 13, 15>(b)};
  }
}
#endif

template <int W>
static inline int fold_all(vf* v, int count) {
  if (count & 1) {
    v[count++] = vf{};  // adding zeros changes no sum
  }
  for (int i = 0; i < count / 2; i++) {
    v[i] = fold<W>(v[2 * i], v[2 * i + 1]);
  }
  return count / 2;
}

// out[i] = the sum of v[i]'s lanes for C <= 16 vectors, in at most 15 vector additions. Each
// sum is taken in the same order (lane i + lane i + 8, then + 4, + 2, + 1) whatever C is.
template <int C>
__attribute__((always_inline)) static inline void hsums(vf* v, float* out) {
  static_assert(C <= 16);
  vf w[17];
  for (int i = 0; i < C; i++) {
    w[i] = v[i];
  }
  int count = fold_all<8>(w, C);
  count = fold_all<4>(w, count);
  count = fold_all<2>(w, count);
  fold_all<1>(w, count);
  std::memcpy(out, &w[0], sizeof(float) * C);
}

}  // namespace macspec
