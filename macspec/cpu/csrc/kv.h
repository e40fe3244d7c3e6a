// A KV cache's keys and values as the layer primitives store and read them: float32, or float16
// where the cache is kept at half the bytes (switches.KV_CACHE; docs/cpu.md, "KV caches in
// float16"). Stored rounded as MLX's astype rounds; read widened exactly, a piece at a time.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <immintrin.h>

#include "common.h"
#include "layer.h"
#include "mlx/array.h"

namespace macspec {

// A KV cache's keys or values: float32, or float16 where the cache is kept at half the bytes
// (switches.KV_CACHE): attention widens each piece of them to float32 once for all its rows.
inline void check_kv(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16) {
    throw std::invalid_argument(std::string("[macspec] float32 or float16 ") + what);
  }
}

// n floats to float16 bits, rounded to nearest even as MLX's astype(float16) rounds them: the
// keys and values a KV cache kept in float16 stores (switches.KV_CACHE).
inline void narrow_rows(const float* x, uint16_t* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128((__m128i*)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), 0));
  }
  for (; i < n; i++) {
    y[i] = _cvtss_sh(x[i], 0);
  }
}

// Where a primitive writes its new keys and values (n floats each) for its outputs kb and vb:
// the outputs themselves, or with `half` a float scratch that store() narrows into them.
class NewKV {
 public:
  NewKV(char* kb, char* vb, size_t n, bool half)
      : kb_(kb), vb_(vb), n_(n), wide_(half ? 2 * n : 0) {
    k = half ? wide_.data() : reinterpret_cast<float*>(kb);
    v = half ? wide_.data() + n : reinterpret_cast<float*>(vb);
  }

  void store() {  // (nothing to do for float32 outputs)
    if (!wide_.empty()) {
      narrow_rows(k, reinterpret_cast<uint16_t*>(kb_), n_);
      narrow_rows(v, reinterpret_cast<uint16_t*>(vb_), n_);
    }
  }

  float* k;
  float* v;

 private:
  char *kb_, *vb_;
  size_t n_;
  std::vector<float> wide_;
};

// Keys or values (1, heads, T, D): float32 or float16 (a cache kept at half the bytes), read
// where they lie when each row of D is contiguous (a KV cache's view), else copied; `head` and
// `row` are the strides between heads and between rows.
struct KV {
  const float* f = nullptr;     // float32 rows
  const uint16_t* h = nullptr;  // float16 rows (IEEE half bits), widened a piece at a time
  size_t head = 0, row = 0;
};

inline KV in_place(const mx::array& x, std::vector<float>& scratch,
                   std::vector<uint16_t>& halves) {
  KV kv;
  const bool half = x.dtype() == mx::float16;
  if (x.strides()[3] == 1 || x.shape(3) == 1) {
    kv.head = x.strides()[1];
    kv.row = x.strides()[2];
    if (half) {
      kv.h = reinterpret_cast<const uint16_t*>(x.data<mx::float16_t>());
    } else {
      kv.f = x.data<float>();
    }
    return kv;
  }
  kv.head = (size_t)x.shape(2) * x.shape(3);
  kv.row = x.shape(3);
  if (!half) {
    kv.f = rows_of(x, scratch);
    return kv;
  }
  halves.resize(x.size());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data<mx::float16_t>());
  for (size_t i = 0; i < x.size(); i++) {
    halves[i] = src[mx::elem_to_loc(static_cast<int>(i), x)];
  }
  kv.h = halves.data();
  return kv;
}

// Rows t0 <= t < t1 of float16 keys or values (stride `row`) as float32 rows of D in `out`:
// each half widened exactly (F16C), so attention sums the same floats whatever reads them.
inline const float* widen(const KV& kv, size_t at, int n, int D, std::vector<float>& out) {
  out.resize((size_t)n * D);
  for (int t = 0; t < n; t++) {
    const uint16_t* src = kv.h + at + (size_t)t * kv.row;
    float* dst = out.data() + (size_t)t * D;
    int d = 0;
    for (; d + 8 <= D; d += 8) {
      store8(dst + d, (f8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + d))));
    }
    for (; d < D; d++) {
      dst[d] = _cvtsh_ss(src[d]);
    }
  }
  return out.data();
}

}  // namespace macspec
