// The small per-step ops of the CPU path that torch runs as one or more ATen calls each:
// storing a step's new K/V rows into the paged cache (plain, or quantized to int8 / fp8
// with a bf16 scale per token and head, as gpu/kv_quant.py defines it), the embedding
// lookup (a row gather), and the argmax of the logits rows of an all-greedy batch.
//
// Each ATen op is its own OpenMP region, and at decode sizes the fork/join costs more than
// the work; on a crowded machine a thread that lost its core stalls every join for a whole
// scheduler slice.  These run on the calling thread unless the work is big enough (a long
// prefill chunk) for a second thread to pay for its wake-up even then.
//
// Results are bitwise those of the torch ops they replace.  The library is built with
// -ffast-math, which lets the compiler assume there are no NaNs or infinities and rewrite
// divisions as reciprocal multiplies; so comparisons here are on integer keys of the float
// bits, and the few divisions that must round as IEEE ones go through an opaque operand.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "entry_points.h"
#include "simd.h"

namespace {

using namespace ps;

// Elements (K and V together; a quantized one counts kQuantCost) a second thread must have
// at least: a copy of that much takes ~100 us, against the microseconds of a quiet wake-up
// and the milliseconds of a crowded one.  Decode steps never reach it.
constexpr int64_t kParallelWork = int64_t{1} << 20;
constexpr int64_t kQuantCost = 8;  // a quantized element: abs-max pass, scale, round, store
// Logits elements a second argmax thread must have at least (~4 x 32k-vocab rows).
constexpr int64_t kParallelArgmax = int64_t{1} << 17;

inline int team(int64_t work, int64_t per_thread, int nthreads, int items) {
  return static_cast<int>(std::clamp<int64_t>(work / per_thread, 1, std::min(nthreads, items)));
}

inline float load_f(const float* p) { return *p; }
inline float load_f(const uint16_t* p) { return to_f(*p); }

// A value the optimizer cannot see through, so a division by it stays an IEEE division.
inline float opaque(float x) {
  asm volatile("" : "+m"(x));
  return x;
}

inline uint16_t bf16_rne(float x) {  // finite x
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Round to nearest even of m / 2^s, 0 < s < 32.
inline uint32_t rne_shift(uint32_t m, int s) {
  return (m + (uint32_t{1} << (s - 1)) - 1 + ((m >> s) & 1u)) >> s;
}

// float -> float8 e4m3fn byte, round to nearest even, for |x| <= 448 (the caller clamps);
// in integer arithmetic only, as the bits of x.
inline uint8_t fp8_e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  uint32_t r;
  if (a >= (121u << 23)) {  // >= 2^-6, the smallest normal: rebias 127 -> 7, keep 3 bits
    r = rne_shift(a - (120u << 23), 20);
  } else {  // subnormal: a multiple of 2^-9 (0 .. 8; 8 is the smallest normal's code)
    const int e = static_cast<int>(a >> 23) - 127;  // <= -7
    const int s = 14 - e;                           // m * 2^(e - 23) / 2^-9 = m >> s
    r = (a >> 23) == 0 || s >= 32 ? 0 : rne_shift((a & 0x7fffffu) | 0x800000u, s);
  }
  return static_cast<uint8_t>(sign | r);
}

// One token's head row: values and its scale, as gpu.kv_quant.quantize computes them
// (amax / top rounded to bf16 first, values against the rounded scale).  torch rounds
// y = x * inv before adding 0.5: contracting the two into an FMA moves values near a
// half to the other integer, so contraction is off here.
#if defined(__clang__)
#define PS_NO_CONTRACT
#else
#define PS_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
template <typename T, bool Int8>
PS_NO_CONTRACT void quantize_row(const T* x, int dim, uint8_t* dst, uint16_t* scale) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  float amax = 0.0f;
  for (int d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(load_f(x + d)));
  amax = std::max(amax, 1e-12f);
  const uint16_t s = bf16_rne(amax / opaque(Int8 ? 127.0f : 448.0f));
  *scale = s;
  const float inv = 1.0f / opaque(to_f(s));
  for (int d = 0; d < dim; ++d) {
    const float y = load_f(x + d) * inv;
    if constexpr (Int8) {
      const float r = std::clamp(std::floor(y + 0.5f), -127.0f, 127.0f);
      dst[d] = static_cast<uint8_t>(static_cast<int8_t>(r));
    } else {
      dst[d] = fp8_e4m3(std::clamp(y, -448.0f, 448.0f));
    }
  }
}

struct KvArgs {
  int kind;  // -1: plain copy; 0: int8; 1: fp8
  const void *k, *v;
  int64_t ks, vs;  // token strides of k and v (elements)
  void *kc, *vc;
  uint16_t *ksc, *vsc;  // quantized: [slots, nkv] bf16 scales
  const int64_t* slots;
  int ntok, nkv, dim;
};

template <typename T>
void write_kv(const KvArgs& a, int nthreads) {
  const int64_t row = int64_t{a.nkv} * a.dim;
  const int64_t work = 2 * a.ntok * row * (a.kind < 0 ? 1 : kQuantCost);
#pragma omp parallel for num_threads(team(work, kParallelWork, nthreads, a.ntok))
  for (int t = 0; t < a.ntok; ++t) {
    const int64_t slot = a.slots[t];
    if (slot < 0) continue;  // a padding row (as the Triton write kernel skips it)
    for (int which = 0; which < 2; ++which) {
      const T* src = static_cast<const T*>(which ? a.v : a.k) + t * (which ? a.vs : a.ks);
      if (a.kind < 0) {
        T* dst = static_cast<T*>(which ? a.vc : a.kc) + slot * row;
        std::memcpy(dst, src, sizeof(T) * row);
        continue;
      }
      uint8_t* dst = static_cast<uint8_t*>(which ? a.vc : a.kc) + slot * row;
      uint16_t* sc = (which ? a.vsc : a.ksc) + slot * a.nkv;
      for (int h = 0; h < a.nkv; ++h) {
        if (a.kind == 0)
          quantize_row<T, true>(src + h * a.dim, a.dim, dst + h * a.dim, sc + h);
        else
          quantize_row<T, false>(src + h * a.dim, a.dim, dst + h * a.dim, sc + h);
      }
    }
  }
}

// ---- argmax ---------------------------------------------------------------------------

// An integer with the float's order, where torch's argmax order needs it: -0 == +0, and
// every NaN equal to each other and above everything (torch propagates NaN, so the first
// NaN is the argmax).  bits: the fp32 bits (bf16: its 16 bits << 16).
inline vi order_key(vi bits) {
  const vi mag = bits & 0x7fffffff;
  const vi key = bits < 0 ? -mag : mag;
  return mag > 0x7f800000 ? vi{} + std::numeric_limits<int32_t>::max() : key;
}
inline int32_t order_key(int32_t bits) {
  const int32_t mag = bits & 0x7fffffff;
  return mag > 0x7f800000 ? std::numeric_limits<int32_t>::max() : (bits < 0 ? -mag : mag);
}
inline vi bits_of(const float* p) {
  vi b;
  std::memcpy(&b, p, sizeof b);
  return b;
}
inline vi bits_of(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vi)(__builtin_convertvector(h, vu) << 16);
}
inline int32_t bits_of1(const float* p) {
  int32_t b;
  std::memcpy(&b, p, 4);
  return b;
}
inline int32_t bits_of1(const uint16_t* p) { return static_cast<int32_t>(uint32_t{*p} << 16); }

// First index of the row's maximum.  kAcc independent (max, index) vectors, so the
// compare-select chains overlap; each lane keeps its first maximum (strictly greater
// replaces), and the lanes are merged as (largest key, then smallest index).
template <typename T>
int64_t argmax_row(const T* x, int cols) {
  constexpr int kAcc = 4;
  constexpr int kStep = kAcc * kW;
  int32_t best = std::numeric_limits<int32_t>::min();
  int64_t at = 0;
  int j = 0;
  if (cols >= kStep) {
    vi bk[kAcc], bi[kAcc], idx[kAcc];
    vi lane{};  // built whole, then offset: lane-by-lane writes into idx[u] warn (-march=x86-64)
    for (int l = 0; l < kW; ++l) lane[l] = l;
    for (int u = 0; u < kAcc; ++u) {
      idx[u] = lane + u * kW;
      bk[u] = order_key(bits_of(x + u * kW));
      bi[u] = idx[u];
    }
    for (j = kStep; j + kStep <= cols; j += kStep) {
#pragma GCC unroll 4
      for (int u = 0; u < kAcc; ++u) {
        idx[u] += kStep;
        const vi k = order_key(bits_of(x + j + u * kW));
        const vi gt = k > bk[u];
        bk[u] = gt ? k : bk[u];
        bi[u] = gt ? idx[u] : bi[u];
      }
    }
    for (int u = 0; u < kAcc; ++u)
      for (int l = 0; l < kW; ++l)
        if (bk[u][l] > best || (bk[u][l] == best && bi[u][l] < at)) {
          best = bk[u][l];
          at = bi[u][l];
        }
  } else {
    best = order_key(bits_of1(x));
    j = 1;
  }
  for (; j < cols; ++j) {  // the tail: later than every index above, so only > replaces
    const int32_t k = order_key(bits_of1(x + j));
    if (k > best) {
      best = k;
      at = j;
    }
  }
  return at;
}

template <typename T>
void argmax_rows(const T* x, int64_t rs, int rows, int cols, int64_t* out, int nthreads) {
  const int64_t work = int64_t{rows} * cols;
#pragma omp parallel for num_threads(team(work, kParallelArgmax, nthreads, rows))
  for (int r = 0; r < rows; ++r) out[r] = argmax_row(x + r * rs, cols);
}

// Bytes a second gather thread must have at least (a 2048-token prefill's embedding rows
// are ~4 MiB; a decode step's 64 rows 128 KiB).
constexpr int64_t kParallelGather = int64_t{1} << 21;

}  // namespace

extern "C" {

// k, v: [ntok, nkv, dim] rows at token strides ks / vs (elements), each row dense; stored at
// kc / vc [slots, nkv, dim] row slots[t] (negative: skipped).  kind -1: copied as they are
// (bf16 != 0: 2-byte elements, else fp32); 0 / 1: quantized to int8 / fp8 e4m3 bytes with
// bf16 scales into ksc / vsc [slots, nkv].
void ps_write_kv(int kind, int bf16, const void* k, int64_t ks, const void* v, int64_t vs,
                 void* kc, void* vc, uint16_t* ksc, uint16_t* vsc, const int64_t* slots,
                 int ntok, int nkv, int dim, int nthreads) {
  const KvArgs a{kind, k, v, ks, vs, kc, vc, ksc, vsc, slots, ntok, nkv, dim};
  if (bf16)
    write_kv<uint16_t>(a, nthreads);
  else
    write_kv<float>(a, nthreads);
}

// dst[i] = src[idx[i]], rows of row_bytes (src rows sr bytes apart, dst rows dense).
// Returns the first i whose index is outside [0, nsrc), having copied nothing; else -1.
int64_t ps_gather_rows(const void* src, int64_t sr, int64_t nsrc, const int64_t* idx, int64_t n,
                       void* dst, int64_t row_bytes, int nthreads) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= nsrc) return i;
  const int64_t work = n * row_bytes;
  const int nt = static_cast<int>(std::clamp<int64_t>(work / kParallelGather, 1,
                                                      std::min<int64_t>(nthreads, n)));
#pragma omp parallel for num_threads(nt)
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(static_cast<char*>(dst) + i * row_bytes,
                static_cast<const char*>(src) + idx[i] * sr, row_bytes);
  return -1;
}

// out[r] = the first index of the maximum of row r of x (row stride rs elements), NaN
// counting as the maximum: torch.argmax(x, -1).
void ps_argmax(int bf16, const void* x, int64_t rs, int rows, int cols, int64_t* out,
               int nthreads) {
  if (bf16)
    argmax_rows(static_cast<const uint16_t*>(x), rs, rows, cols, out, nthreads);
  else
    argmax_rows(static_cast<const float*>(x), rs, rows, cols, out, nthreads);
}

}  // extern "C"
