// Vector helpers shared by the CPU attention kernels (paged_decode.cpp, paged_prefill.cpp).
//
// Vectors are GCC/Clang vector extensions of the native width (kW floats: 16 with AVX-512,
// 8 with AVX, 4 otherwise); wider-than-native vectors compile to dreadful code.  The
// library is built with -march=native on the machine that runs it.

#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include "intrinsics.h"
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PS_DPBF16 1
#else
#define PS_DPBF16 0
#endif

namespace ps {

#if defined(__AVX512F__)
constexpr int kW = 16;
#elif defined(__AVX__)
constexpr int kW = 8;
#else
constexpr int kW = 4;  // SSE, NEON
#endif
typedef float vf __attribute__((vector_size(4 * kW)));
typedef int32_t vi __attribute__((vector_size(4 * kW)));
typedef uint32_t vu __attribute__((vector_size(4 * kW)));
typedef uint16_t vh __attribute__((vector_size(2 * kW)));

typedef int8_t vs8 __attribute__((vector_size(kW)));
typedef uint8_t vu8 __attribute__((vector_size(kW)));

// Finite "minus infinity": -ffast-math assumes no infinities, and exp2 of anything this
// negative underflows to exactly 0.
constexpr float kNeg = -1e30f;

inline float to_f(float x) { return x; }
inline float to_f(uint16_t x) {  // bfloat16 -> float: the high half of an fp32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Quantized KV caches (gpu/kv_quant.py): int8 values, or float8 e4m3 ("fn": no infinities;
// NaN is never stored) bytes, each row times a per-(token, head) float scale.
struct fp8 {
  uint8_t b;
};
inline float to_f(int8_t x) { return static_cast<float>(x); }
inline float to_f(fp8 x) {
  // Normal numbers: exponent and mantissa shifted into fp32's fields, bias 7 -> 127.
  // Subnormals (exponent 0): mantissa * 2^-9.
  const uint32_t em = x.b & 0x7fu;
  float mag;
  if (em < 8) {
    mag = static_cast<float>(em) * (1.0f / 512.0f);
  } else {
    const uint32_t bits = (em << 20) + (120u << 23);
    std::memcpy(&mag, &bits, 4);
  }
  return (x.b & 0x80u) ? -mag : mag;
}

inline vf bcast(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kW fp8 bytes (one per lane, 0..255) -> floats, as to_f(fp8).
inline vf fp8_decode(vi b) {
  const vi em = b & 0x7f;
  const vi nbits = (em << 20) + (120 << 23);
  vf norm;
  std::memcpy(&norm, &nbits, sizeof norm);
  const vf sub = __builtin_convertvector(em, vf) * (1.0f / 512.0f);
  const vf mag = em < 8 ? sub : norm;
  vi bits;
  std::memcpy(&bits, &mag, sizeof bits);
  bits |= (b & 0x80) << 24;
  vf r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// 2^x for x <= ~0 (all the softmax needs).  x = n + f with f in [-0.5, 0.5]; 2^f by a
// polynomial (least-squares fits, constant term pinned to 1 so 2^0 is exact: an unchanged
// running max must rescale by exactly 1), times 2^n.  Degree 5: relative error < 2e-7,
// for fp32.  Degree 3: < 1.2e-4, for probabilities about to be rounded to bf16 (2e-3).
template <int Deg>
inline vf exp2_poly(vf f) {
  static_assert(Deg == 3 || Deg == 5, "fitted degrees");
  vf p;
  if constexpr (Deg == 5) {
    p = bcast(0.0013218672247603536f);
    p = p * f + 0.009671698324382305f;
    p = p * f + 0.05550893023610115f;
    p = p * f + 0.24022237956523895f;
    p = p * f + 0.6931468844413757f;
  } else {
    p = bcast(0.05459282547235489f);
    p = p * f + 0.24221783876419067f;
    p = p * f + 0.6933686137199402f;
  }
  return p * f + 1.0f;
}
#if defined(__AVX512F__)
template <int Deg = 5>
inline vf exp2v(vf x) {
  // vscalefps applies 2^n and flushes to exactly 0 when n is hugely negative.
  const __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (vf)_mm512_scalef_ps((__m512)exp2_poly<Deg>(x - (vf)n), n);
}
#else
template <int Deg = 5>
inline vf exp2v(vf x) {
  // 2^n built in the exponent bits; below -127 the biased exponent is 0: exactly 0.
  x = vmax(x, bcast(-127.4f));
  const vi nb = __builtin_convertvector(x + 127.5f, vi);  // floor(x + 0.5) + 127, >= 0
  const vf p = exp2_poly<Deg>(x - (__builtin_convertvector(nb, vf) - 127.0f));
  const vi bits = nb << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
#endif

// Run-time (rows, cols) -> a table of micro-kernels K<rows, cols> instantiated at
// compile time, so the hot loops have constant trip counts.
template <template <int, int> class K, int NR, int NC, int I = 0, typename Fn>
void fill_table(Fn* t) {
  if constexpr (I < NR * NC) {
    t[I] = &K<I / NC + 1, I % NC + 1>::run;
    fill_table<K, NR, NC, I + 1>(t);
  }
}
template <template <int, int> class K, int NR, int NC, typename Fn>
std::array<Fn, NR * NC> make_table() {
  std::array<Fn, NR * NC> t{};
  fill_table<K, NR, NC>(t.data());
  return t;
}

}  // namespace ps
