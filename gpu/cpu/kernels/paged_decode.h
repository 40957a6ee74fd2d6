// Paged attention for decode queries on CPU.
//
// The torch path has to gather every sequence's scattered KV blocks into a padded dense
// tensor (and transpose it) before it can matmul.  This kernel reads each K and V row once,
// straight from the paged cache, and never pads.
//
// Layout (as the Python side and the Triton kernels use it):
//   q, out       [num_seqs, num_heads, head_dim]   heads x dim dense, any token stride (qs,
//                os elements: q is a view into the fused qkv projection, out a view into
//                the step's output rows; neither is copied)
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] contiguous
//   block_tables [num_seqs, table_stride] int32
//   seq_lens     [num_seqs] int32   (context length including the new token)
//
// Decode attention reads every K/V byte once and does only ~G multiply-adds per element
// with it, so it is bound by memory (when the context is not already in the caches), and
// on a CPU the hard part is keeping enough cache misses in flight: blocks are scattered,
// so the hardware prefetchers cannot follow, and a core only tracks a few dozen misses.
//
// Work item: a sequence's keys (or a range of them) for all its kv heads, so that each
// cache slot's K (and V) row is read whole: a tile's 16 slots of a block are one
// contiguous range.  With too few sequences for the threads, items take fewer kv heads,
// then ranges of a long context (flash-decoding: each range leaves an unnormalised output
// with its max and sum, merged at the end).  Items go longest first to threads that claim
// their next one early, so that its first tile can be prefetched while the current one
// finishes.
//
// An item is one pass over its keys in tiles of 16, with an online softmax:
//   - the next tile's K and V rows are prefetched, a few lines at a time between pieces
//     of the current tile's work (bursts stall on the full miss queue: the core then
//     neither computes nor fetches);
//   - scores: each (key, query head) dot product is a vector of partial sums (dims in
//     lanes, K rows read as they lie) and the tile's 16 vectors are reduced together by a
//     transpose-add tree into one vector of 16 scores: 15 shuffle-add steps instead of 16
//     horizontal sums, and the scores come out in lanes, ready for the softmax;
//   - softmax in base 2 with a polynomial exp2; the running max is only moved when a score
//     passes it by 2^kLazy, so most tiles need neither a horizontal max nor a rescale;
//   - P.V with head-dim chunks in lanes: each V row feeds all the query heads of a kv head
//     from registers; the accumulators stay in L1 between tiles.
//
// bf16 on CPUs with AVX-512 BF16 uses vdpbf16ps for both products (as paged_prefill.cpp):
// QK takes (d, d+1) pairs straight from q and the K rows; for P.V the probabilities are
// rounded to bf16 (as GPU kernels do) and two V rows are interleaved into (key j, key j+1)
// pairs in registers.  Everything else (fp32, bf16 on other CPUs, any head dim) runs an
// fp32 FMA path written with GCC vector extensions of the native width (AVX-512, AVX2,
// SSE/NEON).

//
// This header is the kernel; three files compile it (paged_decode.cpp: float32 and bf16
// caches; paged_decode_int8.cpp, paged_decode_fp8.cpp: the quantized caches), because its
// quantized instantiations took ~18 of the ~22 s a cold build waited on one file; split
// this way the two cores of a CI machine build them side by side.

#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_cache.h"
#include "entry_points.h"
#include "simd.h"

namespace {

using namespace ps;

// ---- tiles ----------------------------------------------------------------------------

#if defined(__AVX512F__)
constexpr int kPvHeads = 6;  // P.V micro-tile: heads x kW-wide chunks (24 of 32 registers)
constexpr int kPvCols = 4;
#else
constexpr int kPvHeads = 4;  // 12 of 16 registers
constexpr int kPvCols = 3;
#endif
constexpr int kTile = 16;  // keys per score tile
static_assert(kTile % kW == 0, "a tile is whole vectors");
// Keys per item at least when a context is split to make more items than threads.
constexpr int kMinChunk = 256;
// Keys (x kv heads) per thread at least: below, waking another thread costs more than the
// work it would take over.
constexpr int kMinKeysPerThread = 256;
constexpr int kMaxGroup = 128;
constexpr int kMaxDim = 256;
// Headroom (base-2 exponent) a score may exceed the running max by before it is moved.
constexpr float kLazy = 8.0f;

// a * b + c, one rounding, never reassociated into a longer sequence (-ffast-math would
// split a dot product's FMA chain into multiplies and adds).
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
using ps::loadv;  // the float overload; a local declaration would otherwise hide it
inline vf loadv(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// The first n (< kW) values, zeros after: rows of odd head dims must not be over-read.
inline vf loadv_part(const float* p, int n) {
#if defined(__AVX512F__)
  return (vf)_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
#else
  vf v = {};
  for (int i = 0; i < n; ++i) v[i] = p[i];
  return v;
#endif
}
inline vf loadv_part(const uint16_t* p, int n) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
  vf v = {};
  for (int i = 0; i < n; ++i) v[i] = to_f(p[i]);
  return v;
#endif
}
// int8 / fp8 cache rows (their scale is applied to the scores and probabilities).
inline vf loadv(const int8_t* p) {
  vs8 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vf);
}
inline vf loadv(const fp8* p) {
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  return fp8_decode(__builtin_convertvector(b, vi));
}
inline vf loadv_part(const int8_t* p, int n) {
  vs8 b = {};
  std::memcpy(&b, p, n);
  return __builtin_convertvector(b, vf);
}
inline vf loadv_part(const fp8* p, int n) {
  vu8 b = {};
  std::memcpy(&b, p, n);
  return fp8_decode(__builtin_convertvector(b, vi));
}
inline bool any_gt(vf v, float x) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
#else
  const vi gt = v > x;
  int any = 0;
  for (int i = 0; i < kW; ++i) any |= gt[i];
  return any != 0;
#endif
}
inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kW; ++i) s += v[i];
  return s;
}

// Stores x * inv as bf16 (round to nearest even, NaN kept quiet) or fp32.
inline void store_row(float* dst, const float* src, float inv, int n) {
  for (int d = 0; d < n; ++d) dst[d] = src[d] * inv;
}
inline void store_row(uint16_t* dst, const float* src, float inv, int n) {
  int d = 0;
  for (; d + kW <= n; d += kW) {
    const vf x = loadv(src + d) * inv;
    vu u;
    std::memcpy(&u, &x, sizeof u);
    const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu nan = (u >> 16) | 0x40u;
    const vu b = (u & 0x7fffffffu) > 0x7f800000u ? nan : r;
    const vh h = __builtin_convertvector(b, vh);
    std::memcpy(dst + d, &h, sizeof h);
  }
  for (; d < n; ++d) {
    uint32_t u;
    const float x = src[d] * inv;
    std::memcpy(&u, &x, 4);
    dst[d] = (u & 0x7fffffffu) > 0x7f800000u
                 ? static_cast<uint16_t>((u >> 16) | 0x40u)
                 : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}


// ---- transpose-add reduction --------------------------------------------------------

// r[j] = sum of the lanes of p[j], for j < kW: kW vectors of partial dot products become
// one vector of scores.  Each level adds pairs of vectors after interleaving them, so that
// every lane of the result holds a partial sum of one of the two inputs; in-lane shuffles
// first (cheap), 128-bit lane crossings last.
#if defined(__AVX512F__)
// (vf and __m512 are the same type to the compiler.)
__attribute__((always_inline)) inline __m512 reduce_add(const __m512* p) {
  __m512 r[8], s[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: a, b, a, b
    const __m512 a = p[2 * i], b = p[2 * i + 1];
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: keys 4i .. 4i+3
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0xee));
  const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x88),
                                  _mm512_shuffle_f32x4(s[0], s[1], 0xdd));
  const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x88),
                                  _mm512_shuffle_f32x4(s[2], s[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xdd));
}

#else
#if defined(__clang__)
#define PS_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PS_SHUF(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif
__attribute__((always_inline)) inline vf reduce_add(const vf* p) {
  vf r[kW / 2];
  for (int i = 0; i < kW / 2; ++i) {
    const vf a = p[2 * i], b = p[2 * i + 1];
#if defined(__AVX__)
    r[i] = PS_SHUF(a, b, 0, 8, 1, 9, 4, 12, 5, 13) + PS_SHUF(a, b, 2, 10, 3, 11, 6, 14, 7, 15);
#else
    r[i] = PS_SHUF(a, b, 0, 4, 1, 5) + PS_SHUF(a, b, 2, 6, 3, 7);
#endif
  }
#if defined(__AVX__)
  const vf s0 = PS_SHUF(r[0], r[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                PS_SHUF(r[0], r[1], 2, 3, 10, 11, 6, 7, 14, 15);
  const vf s1 = PS_SHUF(r[2], r[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                PS_SHUF(r[2], r[3], 2, 3, 10, 11, 6, 7, 14, 15);
  return PS_SHUF(s0, s1, 0, 1, 2, 3, 8, 9, 10, 11) + PS_SHUF(s0, s1, 4, 5, 6, 7, 12, 13, 14, 15);
#else
  return PS_SHUF(r[0], r[1], 0, 1, 4, 5) + PS_SHUF(r[0], r[1], 2, 3, 6, 7);
#endif
}
#endif

// Horizontal max of one vector.
inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0];
  for (int i = 1; i < kW; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

// Software prefetch of a tile's rows, issued a part at a time between pieces of work so the
// loads and the miss queue do not stall in bursts.  Adjacent rows (a tile's slots within
// one cache block, when an item covers all kv heads) merge into one range.  The lines go to
// L2 (prefetcht1), not L1: a miss to L2 does not hold one of the core's few L1 fill
// buffers for its whole trip to memory, so more are in flight, and the loads then hit L2.
// Measured on a 2-core Zen 4 EPYC (bench.cpu_attention, K/V cold in DRAM): 1.2-1.6x the
// L1 hint's rate (9-11 -> 14-16 GB/s) at 2-64 sequences; level when the K/V is cache-hot.
// With a 48 KB L1 (ps::wide_l1: Zen 5) the lines go to L1 (prefetcht0): on a 2-core Zen 5
// EPYC, bf16 K/V cold, 1.25-1.59x the L2 hint's rate (19-22 -> 27-30 GB/s) at 1-64
// sequences in two rounds; float32 level (0.96-1.05x), hot level.
struct Prefetcher {
  uintptr_t lo[2 * kTile], hi[2 * kTile];  // line ranges [lo, hi)
  int nr = 0, cur = 0, lines = 0;
  uintptr_t at = 0, end = 0;  // next line, and the end of range cur (0, 0: all issued)
  const bool l1 = ps::wide_l1();  // prefetcht0, else prefetcht1
  void clear() {
    nr = cur = lines = 0;
    at = end = 0;
  }
  void reset() {
    drain();
    clear();
  }
  void add(const void* p, int bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
    const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + bytes + 63) & ~uintptr_t{63};
    if (nr > 0 && a >= lo[nr - 1] && a <= hi[nr - 1]) {  // extends the last range
      if (b > hi[nr - 1]) {
        lines += static_cast<int>((b - hi[nr - 1]) / 64);
        hi[nr - 1] = b;
        if (cur == nr - 1) end = b;
      }
      return;
    }
    lo[nr] = a;
    hi[nr] = b;
    lines += static_cast<int>((b - a) / 64);
    if (nr++ == 0) {
      at = a;
      end = b;
    }
  }
  // n more lines (fewer when all are issued).
  __attribute__((always_inline)) void issue(int n) {
    while (at != 0 && n > 0) {
      const uintptr_t e = std::min(end, at + 64 * static_cast<uintptr_t>(n));
      const int count = static_cast<int>((e - at) / 64);
      const char* const line = reinterpret_cast<const char*>(at);
      n -= count;
      if (l1)
        for (int i = 0; i < count; ++i) __builtin_prefetch(line + 64 * i, 0, 3);
      else
        for (int i = 0; i < count; ++i) __builtin_prefetch(line + 64 * i, 0, 2);
      at = e;
      if (at == end) {
        if (++cur < nr) {
          at = lo[cur];
          end = hi[cur];
        } else {
          at = end = 0;
        }
      }
    }
  }
  void drain() {
    while (at != 0) issue(1 << 20);
  }
};

// ---- fp32 FMA micro-kernels (fp32 or bf16 cache) ------------------------------------

// Scores of G query heads against one tile of kTile keys: s[g * kTile + j], scaled by c and
// masked (kNeg) for j >= nvalid.  q: [G][qs] fp32, zero padded to nc whole vectors; kp: the
// keys' cache slots, read koff elements in; the last vector of a row holds rem values.
// NC > 0: nc == NC, and the query's vectors stay in registers while the rows stream by (one
// pointer load per row); NC == 0: any nc, a chunk of all the rows at a time.  ksc (quantized
// caches, else null): the keys' scales, applied to the finished dot products.
template <typename T, int NC>
struct QkFma {
  // part[j] = lanes of the dot product of the query (nc vectors, qv: the first NC) with
  // row j; Tail: the last vector holds rem values.
  template <bool Tail>
  __attribute__((always_inline)) static void rows(const vf* qv, const float* qg,
                                                  const T* const* k, int nc, int rem,
                                                  vf* part) {
    if constexpr (NC > 0) {
#pragma GCC unroll 16
      for (int j = 0; j < kW; ++j) {
        const T* r = k[j];
        vf acc = Tail ? qv[NC - 1] * loadv_part(r + kW * (NC - 1), rem) : qv[0] * loadv(r);
#pragma GCC unroll 16
        for (int ci = Tail ? 0 : 1; ci < NC - (Tail ? 1 : 0); ++ci)
          acc = fmadd(qv[ci], loadv(r + kW * ci), acc);
        part[j] = acc;
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < kW; ++j) part[j] = vf{};
      const int full = Tail ? nc - 1 : nc;
      for (int ci = 0; ci < full; ++ci) {
        const vf q = loadv(qg + kW * ci);
#pragma GCC unroll 16
        for (int j = 0; j < kW; ++j) part[j] = fmadd(q, loadv(k[j] + kW * ci), part[j]);
      }
      if (Tail) {
        const vf q = loadv(qg + kW * full);
#pragma GCC unroll 16
        for (int j = 0; j < kW; ++j) part[j] = fmadd(q, loadv_part(k[j] + kW * full, rem), part[j]);
      }
    }
  }
  template <bool Tail>
  static void heads(const float* q, int qs, int G, const T* const* kp, int koff, int nc,
                    int rem, float c, int nvalid, float* s, Prefetcher& pf, int step,
                    const float* ksc) {
    vi iota;
    for (int i = 0; i < kW; ++i) iota[i] = i;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + static_cast<int64_t>(g) * qs;
      pf.issue(step);
      vf qv[NC > 0 ? NC : 1];
#pragma GCC unroll 16
      for (int ci = 0; ci < NC; ++ci) qv[ci] = loadv(qg + kW * ci);
      for (int j0 = 0; j0 < kTile; j0 += kW) {
        const T* k[kW];
#pragma GCC unroll 16
        for (int j = 0; j < kW; ++j) k[j] = kp[j0 + j] + koff;
        vf part[kW];
        rows<Tail>(qv, qg, k, nc, rem, part);
        vf r = reduce_add(part) * c;
        if (ksc) r *= loadv(ksc + j0);
        if (nvalid < j0 + kW) r = iota < nvalid - j0 ? r : bcast(kNeg);
        std::memcpy(s + g * kTile + j0, &r, sizeof r);
      }
    }
  }
  static void run(const float* q, int qs, int G, const T* const* kp, int koff, int nc, int rem,
                  float c, int nvalid, float* s, Prefetcher& pf, int step, const float* ksc) {
    if (rem == kW)
      heads<false>(q, qs, G, kp, koff, nc, rem, c, nvalid, s, pf, step, ksc);
    else
      heads<true>(q, qs, G, kp, koff, nc, rem, c, nvalid, s, pf, step, ksc);
  }
};
// Query vectors per row that QkFma holds in registers, next to kW accumulators.
constexpr int kQkFmaMaxNc = kW == 16 ? 8 : 4;

// o[h][kW ci + i] = o[h][...] * alpha[h] (alpha null: 1) + sum_j p[h * kTile + j] *
// v_j[voff + kW ci + i] for NH heads x NC vectors and keys j < nk; the last vector holds rem
// values (kW: full).
template <typename T, int NH, int NC>
struct PvFma {
  static void run(float* o, int os, const float* alpha, const float* p, const T* const* vp,
                  int voff, int nk, int rem, Prefetcher& pf, int step) {
    vf acc[NH][NC];
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
      for (int ci = 0; ci < NC; ++ci) acc[h][ci] = loadv(o + h * os + kW * ci);
    if (alpha)
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
        for (int ci = 0; ci < NC; ++ci) acc[h][ci] *= alpha[h];
    if (rem == kW) {
      for (int j = 0; j < nk; ++j) {
        if (j % 4 == 0) pf.issue(step);
        vf v[NC];
#pragma GCC unroll 16
        for (int ci = 0; ci < NC; ++ci) v[ci] = loadv(vp[j] + voff + kW * ci);
#pragma GCC unroll 16
        for (int h = 0; h < NH; ++h) {
          const vf pb = bcast(p[h * kTile + j]);
#pragma GCC unroll 16
          for (int ci = 0; ci < NC; ++ci) acc[h][ci] = fmadd(pb, v[ci], acc[h][ci]);
        }
      }
    } else {
      for (int j = 0; j < nk; ++j) {
        if (j % 4 == 0) pf.issue(step);
        vf v[NC];
#pragma GCC unroll 16
        for (int ci = 0; ci < NC - 1; ++ci) v[ci] = loadv(vp[j] + voff + kW * ci);
        v[NC - 1] = loadv_part(vp[j] + voff + kW * (NC - 1), rem);
#pragma GCC unroll 16
        for (int h = 0; h < NH; ++h) {
          const vf pb = bcast(p[h * kTile + j]);
#pragma GCC unroll 16
          for (int ci = 0; ci < NC; ++ci) acc[h][ci] = fmadd(pb, v[ci], acc[h][ci]);
        }
      }
    }
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
      for (int ci = 0; ci < NC; ++ci) std::memcpy(o + h * os + kW * ci, &acc[h][ci], sizeof(vf));
  }
};

#if PS_DPBF16
// ---- AVX-512 BF16 micro-kernels -----------------------------------------------------

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// As QkFma, with bf16 q [G][qs] (zero padded to NC chunks of 32 dims, held in registers)
// and K rows; the last chunk of a row is read under `last` (dims not a multiple of 32).
template <int NC>
struct QkDot {
  static void run(const uint16_t* q, int qs, int G, const uint16_t* const* kp, int koff,
                  __mmask32 last, float c, int nvalid, float* s, Prefetcher& pf, int step) {
    const __mmask16 valid = static_cast<__mmask16>(nvalid >= 16 ? 0xffffu : (1u << nvalid) - 1);
    const __m512 neg = _mm512_set1_ps(kNeg);
    for (int g = 0; g < G; ++g) {
      const uint16_t* qg = q + static_cast<int64_t>(g) * qs;
      pf.issue(step);
      __m512bh qv[NC];
#pragma GCC unroll 16
      for (int ci = 0; ci < NC; ++ci) qv[ci] = as_bh(_mm512_load_si512(qg + 32 * ci));
      __m512 part[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const uint16_t* k = kp[j] + koff;
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[NC - 1],
                                      as_bh(_mm512_maskz_loadu_epi16(last, k + 32 * (NC - 1))));
#pragma GCC unroll 16
        for (int ci = 0; ci < NC - 1; ++ci)
          acc = _mm512_dpbf16_ps(acc, qv[ci], as_bh(_mm512_loadu_si512(k + 32 * ci)));
        part[j] = acc;
      }
      const __m512 r = _mm512_mul_ps(reduce_add(part), _mm512_set1_ps(c));
      _mm512_storeu_ps(s + g * kTile, _mm512_mask_mov_ps(neg, valid, r));
    }
  }
};

// o[h][16 k + i] (k < 2 NC) = o[h][...] * alpha[h] (alpha null: 1) + sum over key pairs
// i2 < npair of the bf16 probabilities pp[h * kTile / 2 + i2] = (p[2 i2], p[2 i2 + 1]) times
// V rows 2 i2, 2 i2 + 1 at voff + 32 chunk + ...: NH heads x NC chunks of 32 dims; the
// block's last chunk is read under `last`.  The two V rows are interleaved into (key,
// key + 1) pairs by in-lane word unpacks (cheaper than a full permute), which leaves each
// chunk's 32 dims in o out of order; unpermute() restores it at the end.
template <int NH, int NC>
struct PvDot {
  static void run(float* o, int os, const float* alpha, const uint32_t* pp,
                  const uint16_t* const* vp, int voff, int npair, __mmask32 last, Prefetcher& pf,
                  int step) {
    __m512 acc[NH][2 * NC];
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
      for (int k = 0; k < 2 * NC; ++k) acc[h][k] = _mm512_loadu_ps(o + h * os + 16 * k);
    if (alpha)
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
        for (int k = 0; k < 2 * NC; ++k)
          acc[h][k] = _mm512_mul_ps(acc[h][k], _mm512_set1_ps(alpha[h]));
    for (int i = 0; i < npair; ++i) {
      if (i % 2 == 0) pf.issue(step);
      const uint16_t* a = vp[2 * i] + voff;
      const uint16_t* b = vp[2 * i + 1] + voff;
      __m512bh vv[2 * NC];
#pragma GCC unroll 16
      for (int ci = 0; ci < NC; ++ci) {
        const __mmask32 m = ci == NC - 1 ? last : ~__mmask32{0};
        const __m512i va = _mm512_maskz_loadu_epi16(m, a + 32 * ci);
        const __m512i vb = _mm512_maskz_loadu_epi16(m, b + 32 * ci);
        vv[2 * ci] = as_bh(_mm512_unpacklo_epi16(va, vb));
        vv[2 * ci + 1] = as_bh(_mm512_unpackhi_epi16(va, vb));
      }
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h) {
        const __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(pp[h * (kTile / 2) + i])));
#pragma GCC unroll 16
        for (int k = 0; k < 2 * NC; ++k) acc[h][k] = _mm512_dpbf16_ps(acc[h][k], pb, vv[k]);
      }
    }
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
      for (int k = 0; k < 2 * NC; ++k) _mm512_storeu_ps(o + h * os + 16 * k, acc[h][k]);
  }
};
// PvDot's accumulators for a 32-dim chunk: lane 4 L + k of the first holds dim 8 L + k, of
// the second dim 8 L + 4 + k (L: 128-bit lane).  Back to dims 0..31 in order:
inline void unpermute(float* o) {
  alignas(64) static const int32_t lo_idx[16] = {0, 1, 2, 3, 16, 17, 18, 19,
                                                 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t hi_idx[16] = {8,  9,  10, 11, 24, 25, 26, 27,
                                                 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512 a = _mm512_loadu_ps(o), b = _mm512_loadu_ps(o + 16);
  _mm512_storeu_ps(o, _mm512_permutex2var_ps(a, _mm512_load_si512(lo_idx), b));
  _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a, _mm512_load_si512(hi_idx), b));
}
constexpr int kPvDotHeads = 6;
constexpr int kPvDotCols = 2;  // chunks of 32 dims: 6 x 4 accumulators
#endif  // PS_DPBF16

template <template <int> class K, int N, int I = 0, typename Fn>
void fill_table1(Fn* t) {
  if constexpr (I < N) {
    t[I] = &K<I + 1>::run;
    fill_table1<K, N, I + 1>(t);
  }
}
template <template <int> class K, int N, typename Fn>
std::array<Fn, N> make_table1() {
  std::array<Fn, N> t{};
  fill_table1<K, N>(t.data());
  return t;
}
template <typename T>
struct QkFmaOf {
  template <int NC>
  using K = QkFma<T, NC>;
};
template <typename T>
struct PvFmaOf {
  template <int NH, int NC>
  using K = PvFma<T, NH, NC>;
};

// ---- driver -------------------------------------------------------------------------

// T: q and out (float or bf16 bits); C: cache values (T, or int8_t / fp8 with scales).
template <typename T, typename C = T>
struct Args {
  const T* q;
  const C* kc;
  const C* vc;
  const int32_t* tables;
  int64_t tstride;
  const int32_t* lens;
  T* out;
  int nseq, nheads, nkv, dim, bs;
  float scale;
  int64_t qs, os;  // token strides of q and out, in elements
  const uint16_t* ks = nullptr;  // quantized: [num_blocks, bs, nkv] bf16 scales of kc / vc
  const uint16_t* vs = nullptr;
};

// Keys [k0, k1) of sequence seq for kv heads [h0, h1).
struct Item {
  int seq, h0, h1, k0, k1;
  int part;  // -1: the whole context, written to out; else its slot among the partials
};

// K and V are prefetched one tile ahead: the cache blocks are scattered, so the hardware
// prefetchers cannot run ahead of the loads by themselves (and further ahead measured
// slower: more lines in flight than the core can track).
constexpr int kRing = 2;

// Per-thread scratch (kept between calls: OpenMP threads persist), sized for the largest item.
template <typename T>
struct Work {
  std::vector<vf> q, o, lsum, s;
  std::vector<float> m, alpha;
  const T* kp[kRing * kTile];  // slot pointers of the current and the next tile
  const T* vp[kRing * kTile];
  Prefetcher pf;
  // The item whose first tile the previous item prefetched, and that tile's slots.
  const Item* pre = nullptr;
  const T* pre_kp[kTile];
  const T* pre_vp[kTile];
  alignas(64) float ksc[kTile];  // quantized: the tile's key / value scales of one kv head
  alignas(64) float vsc[kTile];
  int64_t sidx[kTile];  // and the tile's slots x nkv (scale index of head 0)
  void reserve(int rows, int group, int dim) {
    const size_t dp = (dim + 31) / 32 * 32;  // whole vectors, whole bf16 chunks of 32
    auto grow = [](auto& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(q, rows * dp / kW);
    grow(o, rows * dp / kW);
    grow(lsum, rows);
    grow(s, group * kTile / kW);
    grow(m, rows);
    grow(alpha, group);
    pf.clear();
    pre = nullptr;
  }
};

template <typename T>
__attribute__((noinline)) Work<T>& thread_work() {
  static thread_local Work<T> w;
  return w;
}

// Walks a sequence's keys in order, yielding cache slot pointers (K and V).
template <typename T>
struct SlotCursor {
  const T *kc, *vc;
  const int32_t* table;
  int64_t slot;  // elements per cache slot
  int bs, key, end, in;
  const T *kr = nullptr, *vr = nullptr;  // set by seek(), unread when k0 >= k1
  template <typename A>
  SlotCursor(const A& a, int seq, int k0, int k1)
      : kc(a.kc), vc(a.vc), table(a.tables + static_cast<int64_t>(seq) * a.tstride),
        slot(static_cast<int64_t>(a.nkv) * a.dim), bs(a.bs), key(k0), end(k1), in(k0 % a.bs) {
    if (k0 < k1) seek(k0 / bs);
  }
  void seek(int blk) {
    const int64_t off = (static_cast<int64_t>(table[blk]) * bs + in) * slot;
    kr = kc + off;
    vr = vc + off;
  }
  // The next kTile keys' slots.  Past the end, the last key's again: its scores are masked
  // and its probabilities exactly 0, and every row read is a real one.
  void tile(const T** kp, const T** vp) {
    int j = 0;
    for (; j < kTile && key < end; ++j) {
      kp[j] = kr;
      vp[j] = vr;
      if (++key < end) {
        if (++in == bs) {
          in = 0;
          seek(key / bs);
        } else {
          kr += slot;
          vr += slot;
        }
      }
    }
    for (; j < kTile; ++j) {
      kp[j] = kp[j - 1];
      vp[j] = vp[j - 1];
    }
  }
};

// One item, a single pass over its keys with an online softmax per tile: o (unnormalised,
// [rows][dp]), m (running max of base-2 scores) and the lane-wise sums lsum per query head.
// While the last tile is computed, the first one of `next` (the item this thread does next,
// if any) is prefetched, so that a new item does not start by waiting on memory.
template <typename T, typename C, bool kDot>
void run_item(const Args<T, C>& a, const Item& it, const Item* next, Work<C>& w) {
  const int G = a.nheads / a.nkv, dim = a.dim, hg = it.h1 - it.h0, rows = hg * G;
  const int dp = (dim + 31) / 32 * 32;
  const int n = it.k1 - it.k0, ntiles = (n + kTile - 1) / kTile;
  const C** kp = w.kp;
  const C** vp = w.vp;
  Prefetcher& pf = w.pf;
  // Slot pointers of a tile into kt/vt, and its rows (the item's heads) queued for prefetch.
  auto queue = [&](const Item& x, SlotCursor<C>& cur, const C** kt, const C** vt) {
    const int nk = std::min(kTile, cur.end - cur.key);
    cur.tile(kt, vt);
    const int bytes = (x.h1 - x.h0) * dim * static_cast<int>(sizeof(C));
    const int64_t hoff = static_cast<int64_t>(x.h0) * dim;
    pf.reset();
    for (int j = 0; j < nk; ++j) pf.add(kt[j] + hoff, bytes);
    for (int j = 0; j < nk; ++j) pf.add(vt[j] + hoff, bytes);
  };
  const bool warm = w.pre == &it;
  SlotCursor<C> cur(a, it.seq, warm ? std::min(it.k1, it.k0 + kTile) : it.k0, it.k1);
  if (warm) {
    std::copy(w.pre_kp, w.pre_kp + kTile, kp);
    std::copy(w.pre_vp, w.pre_vp + kTile, vp);
  } else {
    queue(it, cur, kp, vp);
    pf.drain();
  }
  w.pre = nullptr;
  auto fetch = [&](int t) {  // tile t + 1 of this item, or the first of the next one
    if (t + 1 < ntiles) {
      queue(it, cur, kp + ((t + 1) % kRing) * kTile, vp + ((t + 1) % kRing) * kTile);
    } else if (next) {
      SlotCursor<C> nc(a, next->seq, next->k0, next->k1);
      queue(*next, nc, w.pre_kp, w.pre_vp);
      w.pre = next;
    }
  };

  const T* qsrc =
      a.q + static_cast<int64_t>(it.seq) * a.qs + static_cast<int64_t>(it.h0) * G * dim;
  const float c = a.scale * 1.4426950408889634f;  // softmax in base 2
  float* o = reinterpret_cast<float*>(w.o.data());
  float* s = reinterpret_cast<float*>(w.s.data());
  std::fill(o, o + static_cast<size_t>(rows) * dp, 0.0f);
  for (int r = 0; r < rows; ++r) {
    w.m[r] = kNeg;
    w.lsum[r] = vf{};
  }

  // Online softmax of query head row r over the tile's scores sg: probabilities (handed to
  // `pack`), sums, and the factor the head's accumulator must be rescaled by.  The reference
  // max m is only moved when a score exceeds it by more than kLazy (probabilities up to
  // 2^kLazy are harmless in fp32 and bf16): after the first tiles of a context that is
  // rare, and a tile costs a compare instead of a horizontal max, an exp and a rescale.
  // Returns whether alpha != 1.
  auto softmax = [&](int r, float* sg, float& alpha, auto pack) {
    vf mt = loadv(sg);
    for (int i = 1; i < kTile / kW; ++i) mt = vmax(mt, loadv(sg + kW * i));
    const bool moved = any_gt(mt, w.m[r] + kLazy);
    vf sum = w.lsum[r];
    alpha = 1.0f;
    if (moved) {
      const float mnew = std::max(w.m[r], hmax(mt));
      alpha = exp2v(bcast(w.m[r] - mnew))[0];
      w.m[r] = mnew;
      sum *= alpha;
    }
    const vf mv = bcast(w.m[r]);
    for (int i = 0; i < kTile / kW; ++i) sum += pack(loadv(sg + kW * i) - mv, i);
    w.lsum[r] = sum;
    return moved;
  };
  bool moved[kMaxGroup];
  // The rescale factors of heads g0 .. g0 + nh, or null when all are 1.
  auto scaled = [&](int g0, int nh) -> const float* {
    for (int g = g0; g < g0 + nh; ++g)
      if (moved[g]) return w.alpha.data() + g0;
    return nullptr;
  };

  if constexpr (kDot) {
#if PS_DPBF16
    const int nc = (dim + 31) / 32;
    const __mmask32 last = dim % 32 ? (__mmask32{1} << (dim % 32)) - 1 : ~__mmask32{0};
    uint16_t* q = reinterpret_cast<uint16_t*>(w.q.data());
    for (int r = 0; r < rows; ++r) {
      std::memcpy(q + r * dp, qsrc + r * dim, sizeof(uint16_t) * dim);
      std::fill(q + r * dp + dim, q + (r + 1) * dp, uint16_t{0});
    }
    using Fn = void (*)(float*, int, const float*, const uint32_t*, const uint16_t* const*, int,
                        int, __mmask32, Prefetcher&, int);
    static const auto tab = make_table<PvDot, kPvDotHeads, kPvDotCols, Fn>();
    using QkFn = void (*)(const uint16_t*, int, int, const uint16_t* const*, int, __mmask32, float,
                          int, float*, Prefetcher&, int);
    static const auto qk_tab = make_table1<QkDot, kMaxDim / 32, QkFn>();
    const QkFn qk = qk_tab[nc - 1];
    const int npv_calls =
        (G + kPvDotHeads - 1) / kPvDotHeads * ((nc + kPvDotCols - 1) / kPvDotCols);
    alignas(64) uint32_t pp[kMaxGroup * kTile / 2];
    for (int t = 0; t < ntiles; ++t) {
      fetch(t);
      // Spread the prefetches over the tile's work: a step per query head (scores) and per
      // 4 keys (P.V), so the miss queue is neither idle nor full for long.
      const int steps = hg * (G + kTile / 4 * npv_calls);
      const int step = (pf.lines + steps - 1) / steps;
      const uint16_t* const* kt = kp + (t % kRing) * kTile;
      const uint16_t* const* vt = vp + (t % kRing) * kTile;
      const int nvalid = std::min(kTile, n - kTile * t);
      for (int hi = 0; hi < hg; ++hi) {
        const int h = it.h0 + hi;
        qk(q + hi * G * dp, dp, G, kt, h * dim, last, c, nvalid, s, pf, step);
        for (int g = 0; g < G; ++g)
          moved[g] = softmax(hi * G + g, s + g * kTile, w.alpha[g], [&](vf x, int) {
            // bf16 (key 2i, key 2i + 1) pairs: the P operand of PvDot.
            const vf p = exp2v<3>(x);
            _mm256_store_si256(reinterpret_cast<__m256i*>(pp + g * (kTile / 2)),
                               (__m256i)_mm512_cvtneps_pbh((__m512)p));
            return p;
          });
        const int npair = (nvalid + 1) / 2;
        for (int g0 = 0; g0 < G; g0 += kPvDotHeads) {
          const int nh = std::min(kPvDotHeads, G - g0);
          const float* al = scaled(g0, nh);
          for (int c0 = 0; c0 < nc; c0 += kPvDotCols) {
            const int ncb = std::min(kPvDotCols, nc - c0);
            tab[(nh - 1) * kPvDotCols + ncb - 1](o + (hi * G + g0) * dp + 32 * c0, dp, al,
                                                 pp + g0 * (kTile / 2), vt,
                                                 h * dim + 32 * c0, npair,
                                                 c0 + ncb == nc ? last : ~__mmask32{0}, pf, step);
          }
        }
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int ci = 0; ci < nc; ++ci) unpermute(o + r * dp + 32 * ci);
#endif
  } else {
    const int nc = (dim + kW - 1) / kW, rem = dim - (nc - 1) * kW;
    float* q = reinterpret_cast<float*>(w.q.data());
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < dim; ++d) q[r * dp + d] = to_f(qsrc[r * dim + d]);
      std::fill(q + r * dp + dim, q + (r + 1) * dp, 0.0f);
    }
    using Fn = void (*)(float*, int, const float*, const float*, const C* const*, int, int, int,
                        Prefetcher&, int);
    static const auto tab = make_table<PvFmaOf<C>::template K, kPvHeads, kPvCols, Fn>();
    using QkFn = void (*)(const float*, int, int, const C* const*, int, int, int, float, int,
                          float*, Prefetcher&, int, const float*);
    static const auto qk_tab = make_table1<QkFmaOf<C>::template K, kQkFmaMaxNc, QkFn>();
    const QkFn qk = nc <= kQkFmaMaxNc ? qk_tab[nc - 1] : &QkFma<C, 0>::run;
    constexpr bool kQuant = !std::is_same_v<C, T>;
    const int npv_calls = (G + kPvHeads - 1) / kPvHeads * ((nc + kPvCols - 1) / kPvCols);
    for (int t = 0; t < ntiles; ++t) {
      fetch(t);
      const int steps = hg * (G + kTile / 4 * npv_calls);
      const int step = (pf.lines + steps - 1) / steps;
      const C* const* kt = kp + (t % kRing) * kTile;
      const C* const* vt = vp + (t % kRing) * kTile;
      const int nvalid = std::min(kTile, n - kTile * t);
      if constexpr (kQuant)  // K and V share slots, so one index serves both scales
        for (int j = 0; j < kTile; ++j) w.sidx[j] = (kt[j] - a.kc) / dim;
      for (int hi = 0; hi < hg; ++hi) {
        const int h = it.h0 + hi;
        const float* ksc = nullptr;
        if constexpr (kQuant) {
          for (int j = 0; j < kTile; ++j) {
            w.ksc[j] = to_f(a.ks[w.sidx[j] + h]);
            w.vsc[j] = to_f(a.vs[w.sidx[j] + h]);
          }
          ksc = w.ksc;
        }
        qk(q + hi * G * dp, dp, G, kt, h * dim, nc, rem, c, nvalid, s, pf, step, ksc);
        for (int g = 0; g < G; ++g) {
          float* sg = s + g * kTile;
          moved[g] = softmax(hi * G + g, sg, w.alpha[g], [&](vf x, int i) {
            const vf p = exp2v(x);
            // Quantized: P.V reads p * v_scale (the sum keeps p itself).
            const vf pv = kQuant ? p * loadv(w.vsc + kW * i) : p;
            std::memcpy(sg + kW * i, &pv, sizeof pv);
            return p;
          });
        }
        for (int g0 = 0; g0 < G; g0 += kPvHeads) {
          const int nh = std::min(kPvHeads, G - g0);
          const float* al = scaled(g0, nh);
          for (int c0 = 0; c0 < nc; c0 += kPvCols) {
            const int ncb = std::min(kPvCols, nc - c0);
            tab[(nh - 1) * kPvCols + ncb - 1](o + (hi * G + g0) * dp + kW * c0, dp, al,
                                              s + g0 * kTile, vt,
                                              h * dim + kW * c0, nvalid,
                                              c0 + ncb == nc ? rem : kW, pf, step);
          }
        }
      }
    }
  }
}

template <typename T, typename C = T>
void decode(const Args<T, C>& a, int nthreads) {
  const int G = a.nheads / a.nkv, dim = a.dim;
  const int dp = (dim + 31) / 32 * 32;
  nthreads = std::max(1, nthreads);
  // Items: all kv heads of a sequence, whose slots are then read whole (the best access
  // pattern for scattered blocks).  With too few sequences for ~4 items per thread, long
  // contexts are cut into ranges of keys (no shorter than kMinChunk; flash-decoding), and
  // only where that is not enough do items take fewer kv heads.
  int64_t keys = 0;
  for (int s = 0; s < a.nseq; ++s) keys += std::max(0, a.lens[s]);
  const int64_t total = keys * a.nkv;  // keys x kv heads
  const int target = 4 * nthreads;
  const int64_t want = (keys + target - 1) / target;  // keys per item, for ~target items
  const int chunk =
      static_cast<int>(std::max<int64_t>(kMinChunk, (want + kTile - 1) / kTile * kTile));
  int64_t ranges = 0;
  for (int s = 0; s < a.nseq; ++s) ranges += (std::max(0, a.lens[s]) + chunk - 1) / chunk;
  int hg = a.nkv;
  while (hg > 1 && ranges * ((a.nkv + hg - 1) / hg) < target) hg = (hg + 1) / 2;
  struct Split {
    int seq, h0, h1, part0, nparts;
  };
  std::vector<Item> items;
  std::vector<Split> splits;
  int nparts_total = 0;
  for (int s = 0; s < a.nseq; ++s) {
    const int len = a.lens[s];
    if (len <= 0) {
      std::memset(a.out + static_cast<int64_t>(s) * a.os, 0, sizeof(T) * a.nheads * dim);
      continue;
    }
    const int np = (len + chunk - 1) / chunk;
    const int per = ((len + np - 1) / np + kTile - 1) / kTile * kTile;  // whole tiles
    for (int h0 = 0; h0 < a.nkv; h0 += hg) {
      const int h1 = std::min(a.nkv, h0 + hg);
      if (np == 1) {
        items.push_back({s, h0, h1, 0, len, -1});
        continue;
      }
      splits.push_back({s, h0, h1, nparts_total, 0});
      for (int k0 = 0; k0 < len; k0 += per) {
        items.push_back({s, h0, h1, k0, std::min(len, k0 + per), nparts_total++});
        ++splits.back().nparts;
      }
    }
  }
  if (items.empty()) return;
  // Most work first, then dynamic scheduling: the threads finish together.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    return static_cast<int64_t>(x.k1 - x.k0) * (x.h1 - x.h0) >
           static_cast<int64_t>(y.k1 - y.k0) * (y.h1 - y.h0);
  });
  // Partials: per query head of the item, o [dp], then m, l.
  const int rows = hg * G;
  const int64_t pstride = static_cast<int64_t>(rows) * (dp + 2);
  std::vector<float> parts(static_cast<size_t>(nparts_total) * pstride);
  const int ni = static_cast<int>(items.size()), ns = static_cast<int>(splits.size());
  constexpr bool kDotOk = PS_DPBF16 && std::is_same_v<T, uint16_t> && std::is_same_v<C, T>;
  const bool dot = kDotOk;

  // Dynamic scheduling by hand: a thread claims its next item before it finishes the current
  // one, so that it can prefetch the next item's first tile.
  std::atomic<int> claim{0};
  // Waking threads costs microseconds: tiny calls get fewer.
  const int team = static_cast<int>(
      std::clamp<int64_t>(total / kMinKeysPerThread, 1, std::min(nthreads, ni)));
#pragma omp parallel num_threads(team)
  {
    Work<C>& w = thread_work<C>();  // (one TLS lookup, not one per use)
    w.reserve(rows, G, dim);
    int i = claim.fetch_add(1, std::memory_order_relaxed);
    while (i < ni) {
      const int i_next = claim.fetch_add(1, std::memory_order_relaxed);
      const Item& it = items[i];
      const Item* next = i_next < ni ? &items[i_next] : nullptr;
      if (dot) {
        if constexpr (kDotOk) run_item<T, C, true>(a, it, next, w);
      } else {
        run_item<T, C, false>(a, it, next, w);
      }
      const int nr = (it.h1 - it.h0) * G;
      const float* o = reinterpret_cast<const float*>(w.o.data());
      if (it.part >= 0) {
        float* part = parts.data() + it.part * pstride;
        std::memcpy(part, o, sizeof(float) * nr * dp);
        for (int r = 0; r < nr; ++r) {
          part[nr * dp + r] = w.m[r];
          part[nr * dp + nr + r] = hsum(w.lsum[r]);
        }
      } else {
        T* dst = a.out + static_cast<int64_t>(it.seq) * a.os + it.h0 * G * dim;
        for (int r = 0; r < nr; ++r)
          store_row(dst + r * dim, o + r * dp, 1.0f / hsum(w.lsum[r]), dim);
      }
      i = i_next;
    }
    // Merge the ranges of split contexts: rescale each to the common max.  (ns is the same
    // for every thread, so all or none meet the barrier.)
    if (ns > 0) {
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < ns; ++i) {
        const Split& sp = splits[i];
        const int nr = (sp.h1 - sp.h0) * G;
        float* acc = reinterpret_cast<float*>(w.o.data());
        T* dst = a.out + static_cast<int64_t>(sp.seq) * a.os + sp.h0 * G * dim;
        for (int r = 0; r < nr; ++r) {
          float mmax = kNeg;
          for (int k = 0; k < sp.nparts; ++k)
            mmax = std::max(mmax, parts[(sp.part0 + k) * pstride + nr * dp + r]);
          float l = 0.0f;
          std::fill(acc, acc + dim, 0.0f);
          for (int k = 0; k < sp.nparts; ++k) {
            const float* pk = parts.data() + (sp.part0 + k) * pstride;
            const float f = std::exp2(pk[nr * dp + r] - mmax);
            l += f * pk[nr * dp + nr + r];
            for (int d = 0; d < dim; ++d) acc[d] += f * pk[r * dp + d];
          }
          store_row(dst + r * dim, acc, 1.0f / l, dim);
        }
      }
    }
  }
}

}  // namespace

// The quantized caches' drivers, one per file (the cache type C: int8_t or fp8), behind
// ps_decode_quant; q and out are bf16 when bf16 != 0, else fp32.
namespace ps_paged_decode {
void quant_int8(int bf16, const void* q, int64_t qs, const void* kc, const void* vc,
                const uint16_t* ks, const uint16_t* vs, const int32_t* tables, int64_t tstride,
                const int32_t* lens, void* out, int64_t os, int nseq, int nheads, int nkv,
                int dim, int bs, float scale, int nthreads);
void quant_fp8(int bf16, const void* q, int64_t qs, const void* kc, const void* vc,
               const uint16_t* ks, const uint16_t* vs, const int32_t* tables, int64_t tstride,
               const int32_t* lens, void* out, int64_t os, int nseq, int nheads, int nkv,
               int dim, int bs, float scale, int nthreads);
}  // namespace ps_paged_decode

namespace {

template <typename C>
void decode_quant(int bf16, const void* q, int64_t qs, const void* kc, const void* vc,
                  const uint16_t* ks, const uint16_t* vs, const int32_t* tables,
                  int64_t tstride, const int32_t* lens, void* out, int64_t os, int nseq,
                  int nheads, int nkv, int dim, int bs, float scale, int nthreads) {
  auto run = [&](auto tq) {
    using T = decltype(tq);
    Args<T, C> a{static_cast<const T*>(q), static_cast<const C*>(kc), static_cast<const C*>(vc),
                 tables, tstride, lens, static_cast<T*>(out), nseq, nheads, nkv, dim, bs, scale,
                 qs, os, ks, vs};
    decode<T, C>(a, nthreads);
  };
  if (bf16)
    run(uint16_t{});
  else
    run(float{});
}

}  // namespace
