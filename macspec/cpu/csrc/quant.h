// Products with MLX's affine 4- and 8-bit quantized weights (w = scale * q + bias per group of
// `group` columns), for the `qlinear` primitive (cpu_linear.cpp): float activations
// (cpu_qfloat.cpp) or int8 activations with integer dot products (cpu_qint8.cpp).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace macspec {

// i8: repacked weights' float32 scales (or biases) stored factored, exactly (cpu_q4packed.cpp).
enum class ScaleType { f32, f16, bf16, i8 };

// y (M, N) = x (M, K) @ dequantize(W).T; W packed as MLX packs it (uint32 words, little-endian),
// scales and biases (N, K / group) of one type.
struct QProduct {
  const uint8_t* W;
  const void* scales;
  const void* biases;
  ScaleType type;
  const float* x;
  float* y;
  int M, N, K, bits, group;
  bool packed = false;  // 4-bit weights repacked at load (cpu_q4packed.cpp; int8 products only)
};

// Float activations: each row's result summed in the same order whatever M.
void q_float_products(const QProduct* products, int count);

// Int8 activations, integer dot products, then the same float steps for every row: bit-identical
// whatever M and the threads. Each row is quantized per weight group: d = max|x| / 127 and
// q = x * (127 / max|x|) rounded to nearest even. Only where int8_isa() is not null.
void q_int8_products(const QProduct* products, int count);

// Whether this build takes 4-bit weights repacked (AVX-512 VNNI; cpu_q4packed.cpp).
bool q4_packs();
bool q8_packs();  // whether 8-bit weights repack too (AVX-512 builds)

// Up to 4 products in one job of the thread pool (the threads wait for each other once), each
// computed as alone; products of the same x share its preparation.
constexpr int MAX_JOINED = 4;

// Whether b's x is prepared as a's is: the same rows, group size and bit width.
inline bool same_x(const QProduct& a, const QProduct& b) {
  return a.x == b.x && a.M == b.M && a.K == b.K && a.group == b.group && a.bits == b.bits;
}

// The instructions the int8 products use on this build ("avx512-vnni", ...), or nullptr where
// there are none (the float products run instead).
const char* int8_isa();

static inline float bf16_to_float(uint16_t bits) {  // the top half of a float32
  uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

static inline float f16_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction, not mlx's emulation
#else
  const uint32_t sign = uint32_t(bits & 0x8000) << 16, exp = (bits >> 10) & 31, man = bits & 1023;
  float f;
  if (exp == 31) {
    uint32_t v = sign | 0x7f800000 | (man << 13);
    std::memcpy(&f, &v, 4);
  } else if (exp == 0) {  // zero or subnormal: man * 2^-24
    f = man * (1.0f / 16777216.0f);
    f = sign ? -f : f;
  } else {
    uint32_t v = sign | ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &v, 4);
  }
  return f;
#endif
}

// The element types of scale and bias arrays, as the int8 products' loads tell them apart.
struct f16_bits {
  uint16_t bits;
  static constexpr bool bf16 = false;
};
struct bf16_bits {
  uint16_t bits;
  static constexpr bool bf16 = true;
};
template <ScaleType T>
using scale_elem = std::conditional_t<
    T == ScaleType::f32,
    float,
    std::conditional_t<T == ScaleType::i8,
                       int8_t,
                       std::conditional_t<T == ScaleType::f16, f16_bits, bf16_bits>>>;

// Element i of a scale or bias array as float32.
template <ScaleType T>
static inline float scale_of(const void* a, size_t i) {
  if constexpr (T == ScaleType::f32) {
    return static_cast<const float*>(a)[i];
  } else if constexpr (T == ScaleType::f16) {
    return f16_to_float(static_cast<const uint16_t*>(a)[i]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(a)[i]);
  }
}

}  // namespace macspec
