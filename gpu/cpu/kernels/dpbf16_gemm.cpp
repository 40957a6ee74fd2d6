// bfloat16 GEMM on AVX512-BF16 CPUs without AMX: y = x . w^T (+ bias), x [m, k], w [n, k]
// (nn.Linear), bf16 in and out, float32 accumulation (vdpbf16ps), from one row (decode) to
// thousands (prefill).
// The same layout and loop with one float32 value of k per word and an FMA in place of
// each vdpbf16ps is the float32 GEMM on AVX-512 CPUs (ps_sgemm512, at the end).
//
// Why by hand: on a 2-core AMD EPYC (Zen 5, AVX512-BF16, no AMX) oneDNN's packed bf16
// kernel runs the `mid` model's decode-step GEMMs (16-64 rows, 217 MB of weights streaming
// from memory) at 55-65% of the cores' vdpbf16ps peak, against ~90% on prefill chunks: at
// decode sizes each weight block serves few rows, and the time goes to waiting for it.
// This kernel is the BLIS layout of sgemm.cpp with the products two k at a time, and it
// keeps the weight stream ahead of the arithmetic.  The weight is packed once at load into
// groups of 4 panels of 16 columns, each group's k blocks one after another in memory (a
// thread's share of the weight is one sequential stream), and within a block the 4 panels'
// lines of a k pair side by side (each line 16 columns x 2 bf16, the pair order vdpbf16ps
// reads): a tile walks its block front to back, one stream, where panel after panel (4
// streams 8 KB apart) held the weight's 38-row decode stream 5-10% slower on a Zen 5.  x is copied per call
// per block of up to kMC rows into pairs, one k block of a row after another.  A 6-row x
// 4-panel register tile holds 24 zmm accumulators fed per k pair by 4 panel loads and 6
// broadcasts of x pairs.  A thread runs every row tile of a block of x over a group's k
// block (32 KB; on a 32 KB L1 16 or 256 KB, see kKWLong) while it sits in L1 (or L2), and
// every tile prefetches its share of the next block (where and whether: see Pass::pf),
// spread over its k pairs: a burst of prefetches from the first tile alone overflows the
// core's outstanding misses and left the stream 15-30% slower at 16-64 rows.  Partial sums
// between k blocks live in a per-thread float32 tile buffer, and the last k block rounds
// straight to bf16 into y, so no float32 y is written and read back.
//
// Every output element is the bias plus one sequential sum over the k pairs, whatever m is
// and wherever its row falls in a tile: a row's result does not depend on its batch.
//
// Gated (ps_dpbf16_silu): the MLP's gate_up projection with SiLU(gate) * up applied as the
// last k block is written, so the [m, 2I] gate_up product is never stored and read back
// and the separate elementwise pass (an exp per element, ~2-3% of a Zen 4 step) goes.  Its
// weight is packed with each group holding 32 gate columns and the 32 up columns they
// pair with, so one register tile has both halves of its 32 outputs.  Rounding as the
// unfused path: gate and up rounded to bf16, silu(gate) rounded, the product rounded.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "activation.h"
#include "cpu_cache.h"
#include "entry_points.h"
#include "gemm_common.h"

// The float32 kernel (ps_sgemm512) needs AVX-512F/BW only; the bf16 one AVX512-BF16 too.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "intrinsics.h"
#include <omp.h>
#define PS_ZMM 1
#else
#define PS_ZMM 0
#endif
#if PS_ZMM && defined(__AVX512BF16__)
#define PS_DPBF16 1
#else
#define PS_DPBF16 0
#endif

namespace {

constexpr int kNR = 16;   // columns per panel: one zmm of float32
constexpr int kNP = 4;    // panels per register tile (64 columns)
constexpr int kKC = 256;  // k per block: a group's block is 4 x 128 pairs x 64 B = 32 KB
                          // (float32: 128 values of k, the same 128 words)
// Words of k per block where L1 is 32 KB (Zen 4; ps::wide_l1 CPUs keep kKC / 2, not yet
// measured otherwise).  Long blocks (kKWLong: all of a 2,048-wide k) keep a tile's
// accumulators in registers across k and its x rows (6 x 4 KB) in L1 while the weight
// streams through from L2 in order; with kKC / 2 the 32 KB weight block every tile re-reads
// and the tiles' x competed for the 32 KB L1, and partial sums went through memory every
// 128 words.  Measured on a 2-core Zen 4 EPYC, the projections in sequence, alternated,
// against kKC / 2: the 1B shape 1.07-1.13x at 20-256 rows (split by columns), 1.08-1.12x at
// 512-1,024 (by rows); `mid` 1.04-1.10x and 1.03-1.05x; float32 1.02-1.08x.  Except bf16
// products of up to 16 rows, whose weight comes from memory and is re-read by at most 3
// tiles: there half-sized blocks (kKWNarrow, the weight block and x fit in L1 together) are
// best, 1.04-1.09x at 8-16 rows at the 1B shape; long blocks 0.97-1.00x there.  Same bits
// whatever the block: the packed weight is a group's k pairs in order, however a pass cuts
// it into blocks, and each sum still runs over k in order.
constexpr int kKWNarrow = 64;
constexpr int kKWLong = 1024;
constexpr int kMR = 6;    // rows per register tile
constexpr int kMC = 120;  // rows per block of packed x: 120 x kKC bf16, 60 KB of L2

inline int64_t panels(int64_t n) { return (n + kNR - 1) / kNR; }
inline int64_t pairs(int64_t k) { return (k + 1) / 2; }
// 32-bit words of k per row: bf16 pairs, or float32 values.
inline int64_t words(int64_t k, bool f32) { return f32 ? k : pairs(k); }

#if PS_ZMM

// v as the output type holds it: float32 as is, bf16 rounded to nearest even.
template <bool F32>
inline __m512 rounded(__m512 v) {
#if PS_DPBF16
  if constexpr (!F32) return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
#endif
  return v;  // float32 (a build without AVX512-BF16 never runs the bf16 kernel)
}

// The mask's lanes of v into the output at element `at` of y: float32, or rounded to bf16.
template <bool F32>
inline void store_out(void* y, int64_t at, __mmask16 mask, __m512 v) {
  if constexpr (F32) {
    _mm512_mask_storeu_ps(static_cast<float*>(y) + at, mask, v);
  } else {
#if PS_DPBF16
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + at, mask,
                             (__m256i)_mm512_cvtneps_pbh(v));  // round to nearest even
#endif
  }
}

// MR rows x NP consecutive panels over kp k pairs.  a: the tile's packed x pairs, a[r * kp
// + kk]; b: the group's block (k pair kk of panel j at b + (kk * NP + j) * kNR); c: float32 partial sums (stride
// kNP * kNR), read back unless `first` (then the sums start from the bias, or zero); on the
// `last` k block the sums are rounded to bf16 into y (stride ys; `w` valid columns).  PF:
// prefetch npf consecutive 64-byte lines from pf, spread over the kp pairs, into L1, or
// into L2 only where `l2` (see Pass::pf).  GATED: see
// ps_dpbf16_silu (NP 4: panels 0-1 gate, 2-3 up).  F32: every word is one float32 value of
// k (x and the weight), one FMA per word instead of a vdpbf16ps per pair, and y float32.
template <int MR, int NP, bool PF, bool GATED = false, bool F32 = false>
void tile_kernel(int kp, const uint32_t* a, const uint32_t* b, float* c,
                 bool first, bool last, const float* bias, void* yv, int64_t ys, int w,
                 const uint32_t* pf, int64_t npf, bool l2) {
  constexpr int cs = kNP * kNR;
  const int64_t lpk = (npf + kp - 1) / kp;
  __m512 acc[MR][NP];
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    // Masked: the bias ends at n, which the last panel may pass.
    const int valid = std::max(0, std::min(kNR, w - j * kNR));
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 init = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kNR) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) acc[r][j] = first ? init : _mm512_loadu_ps(c + r * cs + j * kNR);
  }
#pragma GCC unroll 2
  for (int kk = 0; kk < kp; ++kk) {
    if (PF) {  // npf lines from pf, a few per k pair
      for (int64_t l = kk * lpk; l < kk * lpk + lpk && l < npf; ++l) {
        const char* line = reinterpret_cast<const char*>(pf + l * kNR);
        if (l2) {
          _mm_prefetch(line, _MM_HINT_T1);
        } else {
          _mm_prefetch(line, _MM_HINT_T0);
        }
      }
    }
    __m512i bv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) bv[j] = _mm512_loadu_si512(b + (kk * NP + j) * kNR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512i ar = _mm512_set1_epi32(static_cast<int>(a[r * kp + kk]));
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        if constexpr (F32) {
          acc[r][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(ar), _mm512_castsi512_ps(bv[j]), acc[r][j]);
        } else {
#if PS_DPBF16
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)ar, (__m512bh)bv[j]);
#endif
        }
      }
    }
  }
  if (!last) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) _mm512_storeu_ps(c + r * cs + j * kNR, acc[r][j]);
    return;
  }
  if constexpr (GATED) {  // panels 0-1 gate, 2-3 up: 32 outputs a row, all valid
    // silu(gate) * up, rounded as silu_mul rounds (bf16: gate and up to bf16, the product's
    // rounding; silu(gate) through silu_mul's own silu16, the same bits, one call for the
    // tile; rounded, times up, rounded; float32: no rounding between).
    static_assert(NP == 4, "a gated group is 2 gate + 2 up panels");
    alignas(64) float g[MR * 2 * kNR], sg[MR * 2 * kNR];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j) _mm512_store_ps(g + (2 * r + j) * kNR, rounded<F32>(acc[r][j]));
    ps::silu16(g, sg, MR * 2 * kNR);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j) {
        const __m512 s = rounded<F32>(_mm512_load_ps(sg + (2 * r + j) * kNR));
        store_out<F32>(yv, r * ys + j * kNR, 0xffff, _mm512_mul_ps(s, rounded<F32>(acc[r][j + 2])));
      }
    return;
  }
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const int valid = std::min(kNR, w - j * kNR);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) store_out<F32>(yv, r * ys + j * kNR, mask, acc[r][j]);
  }
}

using Kernel = void (*)(int, const uint32_t*, const uint32_t*, float*, bool, bool,
                        const float*, void*, int64_t, int, const uint32_t*, int64_t, bool);

template <int MR, int NP>
constexpr Kernel kern(bool pf, bool gated, bool f32) {
  if constexpr (NP == 4) {
    if (gated && f32)
      return pf ? tile_kernel<MR, 4, true, true, true> : tile_kernel<MR, 4, false, true, true>;
    if (gated) return pf ? tile_kernel<MR, 4, true, true> : tile_kernel<MR, 4, false, true>;
  }
  if (f32) return pf ? tile_kernel<MR, NP, true, false, true> : tile_kernel<MR, NP, false, false, true>;
  return pf ? tile_kernel<MR, NP, true> : tile_kernel<MR, NP, false>;
}

template <int MR>
Kernel pick_np(int np, bool pf, bool gated, bool f32) {
  switch (np) {
    case 1: return kern<MR, 1>(pf, gated, f32);
    case 2: return kern<MR, 2>(pf, gated, f32);
    case 3: return kern<MR, 3>(pf, gated, f32);
    default: return kern<MR, 4>(pf, gated, f32);
  }
}

Kernel pick(int mr, int np, bool pf, bool gated, bool f32) {
  switch (mr) {
    case 1: return pick_np<1>(np, pf, gated, f32);
    case 2: return pick_np<2>(np, pf, gated, f32);
    case 3: return pick_np<3>(np, pf, gated, f32);
    case 4: return pick_np<4>(np, pf, gated, f32);
    case 5: return pick_np<5>(np, pf, gated, f32);
    default: return pick_np<6>(np, pf, gated, f32);
  }
}

inline int plan_tiles(int mb, int (*tiles)[2]) { return ps::plan_row_tiles(mb, kMR, tiles); }

// The k pair (2i, 2i + 1) of row p as one 32-bit word, low half first (vdpbf16ps's order);
// an odd k's last pair is padded with zero.
inline uint32_t pair_at(const uint16_t* row, int64_t i, int64_t k) {
  const uint32_t lo = row[2 * i];
  const uint32_t hi = 2 * i + 1 < k ? row[2 * i + 1] : 0;
  return lo | (hi << 16);
}

// One tile's mr rows of x (stride xs) into the packed pairs of a block of mb rows starting
// r0 rows in: for each k block (first pair q0, kp pairs), the tile's rows' kp words each,
// row after row, at ap + q0 * mb + r0 * kp.  Rows kp words (512 B) apart fall in different
// L1 sets, where x's own rows, k * 2 bytes apart, alias for k = 2,048 or 4,096; and the copy
// is one memcpy a row, not a transpose (which cost 4-6% of the narrow projections' time).
// f32: x is float32 and a word is one value.
void pack_rows(const void* xv, int64_t xs, int mr, int r0, int64_t mb, int64_t k,
               uint32_t* ap, bool f32, int64_t kw_block) {
  // Words with all their values in x (an odd bf16 k's last pair has one).
  const int64_t kpt = words(k, f32), whole = f32 ? k : k / 2;
  const int esz = f32 ? 4 : 2;
  const char* x = static_cast<const char*>(xv);
  for (int64_t q0 = 0; q0 < kpt; q0 += kw_block) {
    const int64_t kp = std::min<int64_t>(kw_block, kpt - q0);
    const int64_t kw = std::max<int64_t>(0, std::min<int64_t>(kp, whole - q0));
    uint32_t* dst = ap + q0 * mb + r0 * kp;
    for (int r = 0; r < mr; ++r) {
      // A bf16 pair is the 32-bit word at row + 2i (little endian: element 2i in the low
      // half); memcpy, as a bf16 view's rows need not be 4-byte aligned.
      std::memcpy(dst + r * kp, x + r * xs * esz + 4 * q0, 4 * kw);  // q0 words in
      for (int64_t kk = kw; kk < kp; ++kk)
        dst[r * kp + kk] = pair_at(reinterpret_cast<const uint16_t*>(x) + r * xs, q0 + kk, k);
    }
  }
}

using ps::scratch;

// One block of mb packed rows (ap; y at its first row) over groups [g0, g1) of the weight:
// every row tile of the block over each k block of a group while that block sits in the
// caches.  wend: the end of what this thread streams (prefetches stop there).
struct Pass {
  const uint32_t* wp;
  int64_t n, np, kpt;
  const float* bias;
  int64_t ys;
  bool gated, f32;
  // Where the tiles prefetch the next block of the weight stream.  On a 32 KB L1 (Zen 4):
  // kL2 for products split by columns (decode sizes), where a thread's weight comes from
  // memory once: the next block prefetched into L1 beside the one the tiles are reading is
  // 64 KB, twice the L1, so with two
  // or more row tiles the block the later tiles reread was evicted and came back from L2
  // (and the prefetched lines were evicted before use); a miss to L2 also holds no L1
  // fill buffer for its trip to memory.  Measured on a 2-core Zen 4 EPYC, the `mid`
  // decode-step projections (217 MB streaming): 1.4-1.7x at 8-16 rows, 1.04-1.07x at 4
  // and 32, level at 38-64 (compute-bound there); the float32 kernel 1.1-1.4x at 4-16
  // rows, level at 38-64.  Prefill-sized products (row split, ~100-row blocks each
  // rereading a block ~20 times) do not take L2 (level to 4% slower there), and bf16 ones
  // take none (kNone): compute-bound at ~20 row tiles a block, the hardware prefetcher
  // keeps up with the sequential stream, and the tiles' prefetches only pulled the next
  // block into L1 early: 2-4% faster without them at 1,024-2,048 rows on the Zen 4 (both
  // orders alternated).  The float32 kernel keeps kL1 there (level to 6% slower without).
  // With a 48 KB L1 (ps::wide_l1: Zen 5) kL1 wins at every size.  On a 2-core Zen 5 EPYC,
  // the same decode-step sequence, medians of 11-21 alternated rounds in both orders: bf16
  // 1.03-1.17x at 16-64 rows (level at 4), float32 1.03-1.09x at 8-64; prefill-sized bf16
  // products 1.02-1.09x at 512-2,048 rows.
  enum class Prefetch { kNone, kL1, kL2 };
  Prefetch pf;
  int64_t kb;  // words of k per block: kKC / 2, kKWNarrow or kKWLong
  // Where block q0 (in pairs) of group g starts: a group's blocks follow one another, so
  // a thread's groups are one sequential stream.
  const uint32_t* block(int64_t q0, int64_t g) const {
    const int64_t gp = std::min<int64_t>(kNP, np - g * kNP);
    return wp + g * kNP * kNR * kpt + q0 * gp * kNR;
  }
  const uint32_t* end_of(int64_t g1) const {
    return g1 < (np + kNP - 1) / kNP ? block(0, g1) : wp + np * kNR * kpt;
  }
  void run(const uint32_t* ap, int64_t mb, const int (*tiles)[2], int ntiles, int64_t g0,
           int64_t g1, const uint32_t* wend, float* c, char* y) const {
    const int esz = f32 ? 4 : 2;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * kNP;
      const int gp = static_cast<int>(std::min<int64_t>(kNP, np - p));
      const int64_t col = p * kNR;
      const int w = static_cast<int>(std::min<int64_t>(kNP * kNR, n - col));
      const int64_t ycol = gated ? col / 2 : col;  // a gated group writes 32 outputs
      for (int64_t q0 = 0; q0 < kpt; q0 += kb) {
        const int kp = static_cast<int>(std::min<int64_t>(kb, kpt - q0));
        const uint32_t* b = block(q0, g);
        const bool first = q0 == 0, last = q0 + kb >= kpt;
        // What follows this block in memory is what the thread reads next: the tiles
        // prefetch the next block, each its share of its lines, up to the end of the
        // thread's groups (at decode sizes on a Zen 5, two blocks ahead measured level
        // to 4% slower with the interleaved panels; none, 10-20% slower).
        const int64_t lines = static_cast<int64_t>(gp) * kp;
        const uint32_t* ahead = b + lines * kNR;
        for (int i = 0; i < ntiles; ++i) {
          const int r0 = tiles[i][0], mr = tiles[i][1];
          const int64_t l0 = lines * i / ntiles, l1 = lines * (i + 1) / ntiles;
          const uint32_t* tpf =
              pf != Prefetch::kNone && ahead + l0 * kNR < wend ? ahead + l0 * kNR : nullptr;
          const int64_t npf = tpf ? std::min<int64_t>(l1 - l0, (wend - tpf) / kNR) : 0;
          pick(mr, gp, tpf != nullptr, gated, f32)(kp, ap + q0 * mb + r0 * kp, b,
                                                  c + static_cast<int64_t>(r0) * kNP * kNR,
                                                  first, last, bias ? bias + col : nullptr,
                                                  y + (r0 * ys + ycol) * esz, ys, w, tpf, npf,
                                                  pf == Prefetch::kL2);
        }
      }
    }
  }
};

// gated: n = 2I columns packed by gated_order (every group 2 gate + 2 up panels), y [m, I]
// gets silu(gate) * up.  f32: x, the packed weight and y are float32 (x and y strides in
// elements either way).
void gemm(const void* xv, int64_t xs, int64_t m, int64_t k, const uint32_t* wp, int64_t n,
          const float* bias, void* yv, int64_t ys, int nthreads, bool gated, bool f32) {
  if (m <= 0 || n <= 0) return;
  const int64_t np = panels(n), kpt = words(k, f32);
  const int64_t ngroups = (np + kNP - 1) / kNP;
  const int esz = f32 ? 4 : 2;
  const char* x = static_cast<const char*>(xv);
  char* y = static_cast<char*>(yv);
  const int64_t nblk = (m + kMC - 1) / kMC;
  const int64_t mc = std::min<int64_t>(m, (m + nblk - 1) / nblk);
  const bool by_rows = nthreads > 1 && nblk >= 2 * nthreads;
  using PF = Pass::Prefetch;
  const PF pf = ps::wide_l1() ? PF::kL1 : !by_rows ? PF::kL2 : f32 ? PF::kL1 : PF::kNone;
  const int64_t kb = ps::wide_l1()                    ? kKC / 2
                     : !by_rows && !f32 && m <= 16 ? kKWNarrow
                                                   : kKWLong;
  const Pass pass{wp, n, np, kpt, bias, ys, gated, f32, pf, kb};
  if (by_rows) {
    // As many blocks for every thread (the last may be short).
    const int64_t nb = (nblk + nthreads - 1) / nthreads * nthreads, mcb = (m + nb - 1) / nb;
    // Prefill-sized: each thread its own blocks of rows over the whole weight, packing its
    // own x.  No barrier between blocks, so a thread that loses its core for a while
    // delays only its own rows, not every block's hand-over (split by columns, both wait
    // at each of a 2,048-row product's 18 blocks).  Each thread streams all of the weight
    // once per block instead of its half: at 100+ rows a block the product is compute-bound
    // either way.  Measured on a 2-core Zen 4 EPYC, 512-2,048 rows, the `mid` shapes:
    // level to 1.1x, the column split's dips (a thread descheduled) gone.
#pragma omp parallel num_threads(nthreads)
    {
      thread_local std::vector<uint32_t> xb;
      thread_local std::vector<float> cbuf;
      uint32_t* ap = scratch(xb, mcb * kpt);
      float* c = scratch(cbuf, static_cast<int64_t>(kMC) * kNP * kNR);
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      int tiles[kMC / 2 + 2][2];
      for (int64_t bi = nb * t / nt; bi < nb * (t + 1) / nt && bi * mcb < m; ++bi) {
        const int64_t m0 = bi * mcb, mb = std::min<int64_t>(mcb, m - m0);
        const int ntiles = plan_tiles(static_cast<int>(mb), tiles);
        for (int i = 0; i < ntiles; ++i)
          pack_rows(x + (m0 + tiles[i][0]) * xs * esz, xs, tiles[i][1], tiles[i][0], mb, k, ap,
                    f32, kb);
        pass.run(ap, mb, tiles, ntiles, 0, ngroups, pass.end_of(ngroups), c,
                 y + m0 * ys * esz);
      }
    }
    return;
  }
  thread_local std::vector<uint32_t> xbuf;
  uint32_t* ap = scratch(xbuf, mc * kpt);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, ngroups)));
#pragma omp parallel num_threads(nt)
  {
    thread_local std::vector<float> cbuf;
    float* c = scratch(cbuf, static_cast<int64_t>(kMC) * kNP * kNR);
    const int t = omp_get_thread_num();
    const int64_t g0 = ngroups * t / nt, g1 = ngroups * (t + 1) / nt;
    int tiles[kMC / 2 + 2][2];
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
      const int64_t mb = std::min<int64_t>(mc, m - m0);
      const int ntiles = plan_tiles(static_cast<int>(mb), tiles);
#pragma omp for schedule(static)
      for (int i = 0; i < ntiles; ++i)
        pack_rows(x + (m0 + tiles[i][0]) * xs * esz, xs, tiles[i][1], tiles[i][0], mb, k, ap,
                  f32, kb);
      pass.run(ap, mb, tiles, ntiles, g0, g1, pass.end_of(g1), c, y + m0 * ys * esz);
#pragma omp barrier  // every thread is done with ap before the next block packs into it
    }
  }
}

// f32: w is float32, one value a word.
void pack(const void* wv, int64_t n, int64_t k, uint32_t* out, int nthreads, bool f32) {
  const int64_t np = panels(n), kpt = words(k, f32), ngroups = (np + kNP - 1) / kNP;
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  const uint32_t* wf = static_cast<const uint32_t*>(wv);
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t g = 0; g < ngroups; ++g) {
    const int64_t gp = std::min<int64_t>(kNP, np - g * kNP);
    uint32_t* dst = out + g * kNP * kNR * kpt;
    for (int64_t q0 = 0; q0 < kpt; q0 += kKC / 2) {
      const int64_t kp = std::min<int64_t>(kKC / 2, kpt - q0);
      for (int64_t kk = 0; kk < kp; ++kk)
        for (int64_t j = 0; j < gp; ++j)
          for (int c = 0; c < kNR; ++c) {
            const int64_t col = (g * kNP + j) * kNR + c;
            *dst++ = col >= n ? 0u : f32 ? wf[col * k + q0 + kk] : pair_at(w + col * k, q0 + kk, k);
          }
    }
  }
}

#endif  // PS_ZMM

// The entry points' bodies; `built`: this build has that kernel (else nothing is done, and
// 0 is returned).  A gated product needs whole groups of 32 gate + 32 up columns.
int run_gemm(bool built, const void* x, int64_t xs, int64_t m, int64_t k, const void* wp,
             int64_t n, const float* bias, void* y, int64_t ys, int nthreads, bool gated,
             bool f32) {
#if PS_ZMM
  if (!built || (gated && n % (kNP * kNR) != 0)) return 0;
  gemm(x, xs, m, k, static_cast<const uint32_t*>(wp), n, bias, y, ys, nthreads, gated, f32);
  return 1;
#else
  (void)built, (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y,
      (void)ys, (void)nthreads, (void)gated, (void)f32;
  return 0;
#endif
}

void run_pack(bool built, const void* w, int64_t n, int64_t k, void* out, int nthreads,
              bool f32) {
#if PS_ZMM
  if (built) pack(w, n, k, static_cast<uint32_t*>(out), nthreads, f32);
#else
  (void)built, (void)w, (void)n, (void)k, (void)out, (void)nthreads, (void)f32;
#endif
}

}  // namespace

extern "C" {

int ps_dpbf16_available() { return PS_DPBF16; }

// Where the kernels prefetch into L1 rather than L2 (cpu_cache.h).
int ps_wide_l1() { return ps::wide_l1(); }

// In bf16 values (two per packed word).
int64_t ps_dpbf16_packed_size(int64_t n, int64_t k) { return panels(n) * kNR * pairs(k) * 2; }

// w [n, k] bf16 -> for each group of 4 panels (the last may have fewer), its blocks of kKC
// values of k in turn (the last may be shorter), each block its k pairs in turn, each k
// pair its panels' 16 columns in turn, each entry the pair (2i, 2i + 1) of one column;
// columns past n and an odd k's last half pair are zeros.
void ps_dpbf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads) {
  run_pack(PS_DPBF16, w, n, k, out, nthreads, false);
}

// x [m, k] bf16 (row stride xs), packed weight from ps_dpbf16_pack, bias [n] float32 or
// null, y [m, n] bf16 (row stride ys), each element rounded once from its float32 sum.
void ps_dpbf16(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
               int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads) {
  run_gemm(PS_DPBF16, x, xs, m, k, wp, n, bias, y, ys, nthreads, false, false);
}

// Gated: wp is ps_dpbf16_pack of the gate_up weight [2I, k] with its rows in gated order
// (for each 32 outputs, their 32 gate rows then their 32 up rows; I a multiple of 32), no
// bias; y [m, I] bf16 (row stride ys) = silu(x . gate^T) * (x . up^T), rounded as the
// unfused product + elementwise silu_mul would.  Returns 0 where it cannot (I % 32 != 0,
// or no AVX512-BF16 build).
int ps_dpbf16_silu(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                   int64_t n, uint16_t* y, int64_t ys, int nthreads) {
  return run_gemm(PS_DPBF16, x, xs, m, k, wp, n, nullptr, y, ys, nthreads, true, false);
}

// float32 on the same layout and loop (one FMA per value of k where the bf16 kernel does a
// vdpbf16ps per pair), for float32 models on AVX-512 CPUs: oneDNN's packed float32 kernel
// streams the decode steps' weights no better than its bf16 one did.  Needs AVX-512F/BW.
int ps_sgemm512_available() { return PS_ZMM; }

// In float32 values.
int64_t ps_sgemm512_packed_size(int64_t n, int64_t k) { return panels(n) * kNR * k; }

// w [n, k] float32 -> ps_dpbf16_pack's layout with one value of k a word.
void ps_sgemm512_pack(const float* w, int64_t n, int64_t k, float* out, int nthreads) {
  run_pack(PS_ZMM, w, n, k, out, nthreads, true);
}

// x [m, k] float32 (row stride xs), packed weight from ps_sgemm512_pack, bias [n] or null,
// y [m, n] float32 (row stride ys): the bias plus one sequential FMA chain over k each.
void ps_sgemm512(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
                 const float* bias, float* y, int64_t ys, int nthreads) {
  run_gemm(PS_ZMM, x, xs, m, k, wp, n, bias, y, ys, nthreads, false, true);
}

// Gated, as ps_dpbf16_silu: wp is ps_sgemm512_pack of the gate_up weight in gated order; y
// [m, I] float32 = silu(x . gate^T) * (x . up^T), the bits of the plain product followed
// by the compiled silu_mul.  Returns 0 where it cannot (I % 32 != 0, or no AVX-512 build).
int ps_sgemm512_silu(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp,
                     int64_t n, float* y, int64_t ys, int nthreads) {
  return run_gemm(PS_ZMM, x, xs, m, k, wp, n, nullptr, y, ys, nthreads, true, true);
}

}  // extern "C"
