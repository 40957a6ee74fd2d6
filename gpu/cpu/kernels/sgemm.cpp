// float32 GEMM on AVX2 CPUs: y = x . w^T (+ bias), x [m, k], w [n, k] (nn.Linear), from one
// row (decode) to thousands (prefill).  A bfloat16 variant (ps_sgemm_bf16) reads bf16
// weights and x, computes in float32 and rounds y to bf16: on CPUs without AVX512-BF16 or
// AMX, oneDNN's bf16 product is emulated and runs several times slower than float32.  And
// ps_sgemm_w16 runs float32 x and y over a float32 weight held in bf16 (all its values are
// bf16 ones, as a bf16 checkpoint's are): ps_sgemm's bits from half the weight bytes.
//
// Why by hand: on an AVX2-only AMD EPYC (Zen 3) oneDNN's packed float32 kernel reaches
// ~100 GFLOP/s of the two cores' ~190 at 32-64 rows, and 5-6 GFLOP/s (a third of the
// memory's speed) at one row, with the weights streaming from DRAM as they do in a decode
// step.  This is the BLIS layout: the weight packed once at load into panels of 16 columns
// (kKC rows of k at a time, each row of a panel one 64-byte line), a 6 x 16 register tile
// of accumulators (12 of the 16 ymm registers) fed by two panel loads and six broadcasts per
// k, each panel kept in L1 while every 6-row tile of x passes over it, and the next block
// prefetched a share under each tile (below).  Panels are split over threads (a share of
// the first three quarters each, the rest claimed in chunks: ps::share_items); each thread
// finishes all of k for a panel before the next, so its output tile never leaves L1.
// With 1-3 rows a tile spans 2-4 panels instead, so enough independent FMAs are in flight
// to run at the memory's speed.  From 4 rows, x is first copied per block of up to kMC rows
// into the order the tiles read it (k-major, a tile's rows side by side), so its rows -- k
// floats apart, which for k = 1,024 is one L1 set -- do not evict each other.
//
// Every output element is one sequential sum over k, bias first, whatever m is and
// wherever its row falls in a tile: a row's result does not depend on its batch.
//
// Gated (ps_sgemm_silu, float32): the MLP's gate_up product with SiLU(gate) * up as its
// epilogue.  The weight's rows are packed in gated_order (cpu_kernels.py), so panel 2j holds
// the gate columns of outputs 16j..16j+15 and panel 2j+1 their up columns; a thread owns
// whole pairs, writes a pair's two panels into a small buffer of its own (L1) and, after
// the up panel's last k block, y's 16 columns as silu(gate) * up.  That saves silu_mul's
// pass over the [m, 2I] product and the write of half of it; the bits are the unfused
// product's followed by silu_mul's (silu16 is the one body both call).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "activation.h"
#include "entry_points.h"
#include "gemm_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "intrinsics.h"
#include <omp.h>
#define PS_SGEMM 1
#else
#define PS_SGEMM 0
#endif

namespace {

constexpr int kNR = 16;   // columns per panel: two ymm registers
constexpr int kKC = 256;  // k per block: a panel block is 16 KB, half of L1
constexpr int kMR = 6;    // rows per register tile
constexpr int kMC = 120;  // rows per block of packed x: 120 x kKC floats, 120 KB of L2

inline int64_t panels(int64_t n) { return (n + kNR - 1) / kNR; }

template <typename WT>
constexpr int kPerLine = 64 / sizeof(WT);  // weights to a cache line

#if PS_SGEMM

// A panel row's 16 weights as floats: columns 0-7 in lo, 8-15 in hi.  bf16 is the high
// half of a float32, so interleaving zeros below each word widens it; the interleave works
// within 128-bit lanes, so a bf16 row is packed with its middle two quarters swapped
// (packed_col) and comes out in column order: one load and two shuffles for 16 weights.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}

// MR rows x NP consecutive panels over kc values of k; c is read back unless `first`
// (then it starts from the bias, or zero).  Prefetch: wide tiles (NP > 1, PF 1) pull in
// NP panels from pf, one line per k (float32 weights) or every other k (bf16: two k rows
// to a line); a one-panel tile pulls in npf consecutive lines from pf, its share of the
// next block (see gemm), one a k from the first k (PF 1) or spread evenly over its kc
// (PF 2; npf <= kc).  The hint asks for L2; Zen 2 and Zen 3 fill L1 with it as well.
template <typename WT, int MR, int NP, int PF, bool PACKED>
void tile_kernel(int kc, const float* a, int64_t as, const WT* b, float* c, int64_t cs,
                 bool first, const float* bias, const WT* pf, int npf) {
  // x row r at k: a[r * as + kk]; packed (see pack_rows): a[kk * MR + r], one contiguous
  // stream, so no row of x shares an L1 set with the others (rows k floats apart alias).
  const int64_t rs = PACKED ? 1 : as, ks = PACKED ? MR : 1;
  const int64_t ps = static_cast<int64_t>(kc) * kNR;
  __m256 acc[MR][2 * NP];
#pragma GCC unroll 8
  for (int j = 0; j < 2 * NP; ++j) {
    const int col = (j / 2) * kNR + (j % 2) * 8;
    const __m256 init = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) acc[r][j] = first ? init : _mm256_loadu_ps(c + r * cs + col);
  }
  int spread = kc - 1;  // PF 2: the first line at the first k, npf of them by the last
  const WT* pfl = pf;
#pragma GCC unroll 4
  for (int kk = 0; kk < kc; ++kk) {
    if constexpr (PF == 2) {
      spread += npf;
      if (spread >= kc) {
        spread -= kc;
        _mm_prefetch(reinterpret_cast<const char*>(pfl), _MM_HINT_T1);
        pfl += kPerLine<WT>;
      }
    } else if constexpr (PF == 1 && NP == 1) {
      if (kk < npf)
        _mm_prefetch(reinterpret_cast<const char*>(pf + kk * kPerLine<WT>), _MM_HINT_T1);
    } else if (PF == 1 && (sizeof(WT) == 4 || kk % 2 == 0)) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(pf + j * ps + kk * kNR), _MM_HINT_T1);
    }
    __m256 bv[2 * NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) load16(b + j * ps + kk * kNR, bv[2 * j], bv[2 * j + 1]);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * rs + kk * ks);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NP; ++j) acc[r][j] = _mm256_fmadd_ps(ar, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NP; ++j)
      _mm256_storeu_ps(c + r * cs + (j / 2) * kNR + (j % 2) * 8, acc[r][j]);
}

template <typename WT>
using Kernel = void (*)(int, const float*, int64_t, const WT*, float*, int64_t, bool,
                        const float*, const WT*, int);

template <typename WT>
struct Kernels {
  // [rows][prefetch: none, one a k, spread]: one panel per tile, x packed.
#define PS_NARROW(r) \
  {tile_kernel<WT, r, 1, 0, true>, tile_kernel<WT, r, 1, 1, true>, tile_kernel<WT, r, 1, 2, true>}
  static constexpr Kernel<WT> narrow[kMR + 1][3] = {
      {nullptr, nullptr, nullptr}, PS_NARROW(1), PS_NARROW(2), PS_NARROW(3),
      PS_NARROW(4),                PS_NARROW(5), PS_NARROW(6)};
#undef PS_NARROW
  // 1-3 rows: 4, 3, 2 panels per tile (8-12 accumulators), x read in place.
  static constexpr Kernel<WT> wide[4][2] = {
      {nullptr, nullptr},
      {tile_kernel<WT, 1, 4, 0, false>, tile_kernel<WT, 1, 4, 1, false>},
      {tile_kernel<WT, 2, 3, 0, false>, tile_kernel<WT, 2, 3, 1, false>},
      {tile_kernel<WT, 3, 2, 0, false>, tile_kernel<WT, 3, 2, 1, false>},
  };
  // The last few panels of a wide product, one at a time.
  static constexpr Kernel<WT> narrow_rows[4] = {
      nullptr, tile_kernel<WT, 1, 1, 0, false>, tile_kernel<WT, 2, 1, 0, false>,
      tile_kernel<WT, 3, 1, 0, false>};
};
constexpr int kWidePanels[4] = {0, 4, 3, 2};

// One tile at output column `col`; a tile reaching past n goes through a local buffer.
template <typename WT>
void run_tile(Kernel<WT> kern, int mr, int np, int kc, const float* a, int64_t as, const WT* b,
              float* y, int64_t ys, int64_t col, int64_t n, bool first, const float* bias,
              const WT* pf, int npf = 0) {
  const int tw = np * kNR;
  const int64_t w = std::min<int64_t>(tw, n - col);
  if (w == tw) {
    kern(kc, a, as, b, y + col, ys, first, bias ? bias + col : nullptr, pf, npf);
    return;
  }
  alignas(32) float tmp[kMR * 4 * kNR];
  alignas(32) float btmp[4 * kNR] = {};
  if (bias)
    for (int j = 0; j < tw; ++j) btmp[j] = j < w ? bias[col + j] : 0.0f;
  if (!first)
    for (int r = 0; r < mr; ++r) std::memcpy(tmp + r * tw, y + r * ys + col, 4 * w);
  kern(kc, a, as, b, tmp, tw, first, bias ? btmp : nullptr, pf, npf);
  for (int r = 0; r < mr; ++r) std::memcpy(y + r * ys + col, tmp + r * tw, 4 * w);
}

using ps::scratch;

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline float to_f32(float f) { return f; }
inline float to_f32(uint16_t h) {  // bfloat16 -> float: the high half of an fp32
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline int plan_tiles(int mb, int (*tiles)[2]) { return ps::plan_row_tiles(mb, kMR, tiles); }

// One tile's mr rows of x (stride xs; float32, or bf16 widened here) into the packed layout
// of a block of mb rows starting r0 rows in: for each k block (k0, kc) the tile's kc x mr
// floats, k-major, at ap + k0 * mb + r0 * kc.
template <typename XT>
void pack_rows(const XT* x, int64_t xs, int mr, int r0, int64_t mb, int64_t k, float* ap) {
  for (int64_t k0 = 0; k0 < k; k0 += kKC) {
    const int64_t kc = std::min<int64_t>(kKC, k - k0);
    float* dst = ap + k0 * mb + r0 * kc;
    for (int64_t kk = 0; kk < kc; ++kk)
      for (int r = 0; r < mr; ++r) dst[kk * mr + r] = to_f32(x[r * xs + k0 + kk]);
  }
}

// 1-3 rows: each tile spans 2-4 panels, x read in place (it is a few KB).
template <typename WT, typename Block>
void wide_gemm(const float* x, int64_t xs, int64_t m, int64_t k, const WT* /*wp*/, int64_t n,
               const float* bias, float* y, int64_t ys, int nthreads, Block block) {
  const int64_t np = panels(n);
  const int group = kWidePanels[m];
  const int64_t ngroups = (np + group - 1) / group;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, ngroups)));
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    // Whole groups per thread, so a thread's last group is short only at the very end.
    const int64_t g0 = ngroups * t / nt, g1 = ngroups * (t + 1) / nt;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * group;
      const int pg = static_cast<int>(std::min<int64_t>(group, np - p));
      for (int64_t k0 = 0; k0 < k; k0 += kKC) {
        const int kc = static_cast<int>(std::min<int64_t>(kKC, k - k0));
        const WT* b = block(k0, p);
        const WT* pf = k0 + kKC < k ? block(k0 + kKC, p) : g + 1 < g1 ? block(0, p + group)
                                                                        : nullptr;
        if (pg == group) {
          run_tile<WT>(Kernels<WT>::wide[m][pf != nullptr], static_cast<int>(m), group, kc, x + k0, xs, b, y,
                   ys, p * kNR, n, k0 == 0, bias, pf);
        } else {  // the last few panels, one at a time
          for (int j = 0; j < pg; ++j)
            run_tile<WT>(Kernels<WT>::narrow_rows[m], static_cast<int>(m), 1, kc, x + k0, xs,
                     b + static_cast<int64_t>(j) * kc * kNR, y, ys, (p + j) * kNR, n, k0 == 0,
                     bias, nullptr);
        }
      }
    }
  }
}

// y[r, j] = silu(g[r, j]) * u[r, j] for one group of 16 outputs.
inline void gate16(const float* g, const float* u, float* y) {
  alignas(32) float s[kNR];
  ps::silu16(g, s, kNR);
  for (int i = 0; i < kNR; ++i) y[i] = s[i] * u[i];
}

// x [m, k] (row stride xs; float32 or bf16), packed weight, bias [n] or null, y [m, n]
// float32 (row stride ys).  gated: n = 2I columns in gated order, no bias, y [m, I].
template <typename WT, typename XT>
void gemm(const XT* x, int64_t xs, int64_t m, int64_t k, const WT* wp, int64_t n,
          const float* bias, float* y, int64_t ys, int nthreads, bool gated = false) {
  thread_local std::vector<float> xbuf, gbuf;
  if (m <= 0 || n <= 0) return;
  if (gated && m <= 3) {  // the whole product first (a few rows), then the epilogue
    float* yf = scratch(gbuf, m * n);
    gemm(x, xs, m, k, wp, n, nullptr, yf, n, nthreads);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n / (2 * kNR); ++j)
        gate16(yf + r * n + 2 * j * kNR, yf + r * n + (2 * j + 1) * kNR, y + r * ys + j * kNR);
    return;
  }
  const int64_t np = panels(n);
  // Where block k0 of panel p starts (every block but the last is kKC deep).
  auto block = [&](int64_t k0, int64_t p) {
    return wp + k0 * np * kNR + p * std::min<int64_t>(kKC, k - k0) * kNR;
  };
  if (m <= 3) {  // x read in place; bf16 rows are widened first (a few KB)
    if constexpr (std::is_same_v<XT, float>) {
      wide_gemm(x, xs, m, k, wp, n, bias, y, ys, nthreads, block);
    } else {
      float* xf = scratch(xbuf, m * k);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; ++i) xf[r * k + i] = to_f32(x[r * xs + i]);
      wide_gemm(static_cast<const float*>(xf), k, m, k, wp, n, bias, y, ys, nthreads, block);
    }
    return;
  }
  // Rows in blocks of at most kMC, as even as they come in whole register tiles: one
  // block's packed x per k block (kMC x kKC floats) stays in L2 while every panel of the
  // thread passes over it.
  const int64_t nblk = (m + kMC - 1) / kMC;
  const int64_t mc = std::min<int64_t>(m, ((m + nblk - 1) / nblk + kMR - 1) / kMR * kMR);
  float* ap = scratch(xbuf, mc * k);
  // Gated: whole (gate, up) pairs of panels an item.
  const int64_t unit = gated ? 2 : 1, units = np / unit;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, units)));
  std::unique_ptr<std::atomic<int64_t>[]> claimed(new std::atomic<int64_t>[nblk]());
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    int tiles[kMC / 2 + 2][2];
    alignas(32) float gu[kMC * 2 * kNR];  // gated: a pair's gate | up, row by row (15 KB)
    for (int64_t m0 = 0, bi = 0; m0 < m; m0 += mc, ++bi) {
      const int64_t mb = std::min<int64_t>(mc, m - m0);
      const int ntiles = plan_tiles(static_cast<int>(mb), tiles);
#pragma omp for schedule(static)
      for (int i = 0; i < ntiles; ++i) pack_rows(x + (m0 + tiles[i][0]) * xs, xs, tiles[i][1],
                                                 tiles[i][0], mb, k, ap);
      // Panel p of the weight over all of k; `next`: the panel this thread runs after it.
      auto panel = [&](int64_t p, int64_t next) {
        // Up to 16 rows (decode batches), a block runs in sub-blocks of 64 k, each passed
        // over by every tile before the next: the tiles after the first reread 4 KB of
        // weights from L1 while the prefetched lines arrive, where a 16 KB block was
        // partly evicted by them.  From 24 rows (compute-bound) whole blocks were as fast
        // or faster (docs/PERFORMANCE.md, the Zen 3 section, has the figures).
        const int sub = mb <= 16 ? 64 : kKC;
        // Up to 32 rows a tile's share of prefetches is spread over its k, which keeps
        // the memory busy under the whole of a short tile; from 48 rows issuing them one
        // a k from the start was as fast or faster.
        const int pfmode = mb <= 32 ? 2 : 1;
        for (int64_t k0 = 0; k0 < k; k0 += kKC) {
          const int kc = static_cast<int>(std::min<int64_t>(kKC, k - k0));
          const WT* b = block(k0, p);
          // The next block of this panel, else the first of the next panel.
          const WT* pf = k0 + kKC < k ? block(k0 + kKC, p) : next >= 0 ? block(0, next)
                                                                         : nullptr;
          const int nsub = (kc + sub - 1) / sub, units = nsub * ntiles;
          const int lines = kc * kNR / kPerLine<WT>;
          for (int h = 0; h < nsub; ++h) {
            const int h0 = h * sub, hc = std::min(sub, kc - h0);
            for (int i = 0; i < ntiles; ++i) {
              const int r0 = tiles[i][0], mr = tiles[i][1];
              // Each tile (and sub-block) pulls in its share of the next block's lines,
              // so the memory is busy under every tile's FMAs, not only the first's.
              const int u = h * ntiles + i;
              const int lo = lines * u / units, hi = lines * (u + 1) / units;
              const WT* tpf = pf && hi > lo ? pf + lo * kPerLine<WT> : nullptr;
              const Kernel<WT> kern = Kernels<WT>::narrow[mr][tpf ? pfmode : 0];
              const float* a = ap + k0 * mb + r0 * kc + h0 * mr;
              const WT* bh = b + h0 * kNR;
              const bool first = k0 == 0 && h == 0;
              if (gated)
                run_tile<WT>(kern, mr, 1, hc, a, 0, bh, gu + r0 * 2 * kNR, 2 * kNR,
                             (p % 2) * kNR, 2 * kNR, first, nullptr, tpf, hi - lo);
              else
                run_tile<WT>(kern, mr, 1, hc, a, 0, bh, y + (m0 + r0) * ys, ys, p * kNR, n,
                             first, bias, tpf, hi - lo);
            }
          }
        }
        if (gated && p % 2 == 1)
          for (int64_t r = 0; r < mb; ++r)
            gate16(gu + r * 2 * kNR, gu + r * 2 * kNR + kNR, y + (m0 + r) * ys + p / 2 * kNR);
      };
      ps::share_items(units, t, nt, claimed[bi], [&](int64_t u, int64_t next) {
        for (int64_t j = 0; j < unit; ++j)
          panel(u * unit + j, j + 1 < unit ? u * unit + j + 1 : next >= 0 ? next * unit : -1);
      });
#pragma omp barrier  // every thread is done with ap before the next block packs into it
    }
  }
}


// Where column j of a panel row sits in the packed row: float32 in order, bf16 with the
// middle quarters swapped (load16).
template <typename WT>
constexpr int packed_col(int j) {
  if constexpr (sizeof(WT) == 4) return j;
  return (j & 3) | ((j & 4) << 1) | ((j & 8) >> 1);
}

template <typename WT>
void pack(const WT* w, int64_t n, int64_t k, WT* out, int nthreads) {
  const int64_t np = panels(n);
  for (int64_t k0 = 0; k0 < k; k0 += kKC) {
    const int64_t kc = std::min<int64_t>(kKC, k - k0);
    WT* blk = out + k0 * np * kNR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < np; ++p)
      for (int64_t kk = 0; kk < kc; ++kk)
        for (int j = 0; j < kNR; ++j) {
          const int64_t col = p * kNR + j;
          blk[(p * kc + kk) * kNR + packed_col<WT>(j)] = col < n ? w[col * k + k0 + kk] : WT(0);
        }
  }
}

#endif  // PS_SGEMM

}  // namespace

extern "C" {

int ps_sgemm_available() { return PS_SGEMM; }

int64_t ps_sgemm_packed_size(int64_t n, int64_t k) { return panels(n) * kNR * k; }

// w [n, k] -> for each block of kKC values of k (the last may be shorter), every panel's
// kc x 16 values in turn; columns past n are zeros.  The bf16 layout is the same, in bf16.
void ps_sgemm_pack(const float* w, int64_t n, int64_t k, float* out, int nthreads) {
#if PS_SGEMM
  pack(w, n, k, out, nthreads);
#else
  (void)w, (void)n, (void)k, (void)out, (void)nthreads;
#endif
}

void ps_sgemm_bf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads) {
#if PS_SGEMM
  pack(w, n, k, out, nthreads);
#else
  (void)w, (void)n, (void)k, (void)out, (void)nthreads;
#endif
}

int64_t ps_sgemm_bf16_packed_size(int64_t n, int64_t k) { return panels(n) * kNR * k; }

// x [m, k] (row stride xs), packed weight from ps_sgemm_pack, bias [n] or null,
// y [m, n] (row stride ys).
void ps_sgemm(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
              const float* bias, float* y, int64_t ys, int nthreads) {
#if PS_SGEMM
  gemm(x, xs, m, k, wp, n, bias, y, ys, nthreads);
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ys,
      (void)nthreads;
#endif
}

// Gated: wp is ps_sgemm_pack of the gate_up weight [2I, k] with its rows in gated order
// (groups of 16), n = 2I, no bias; y [m, I] (row stride ys) = silu(x . gate^T) * (x . up^T),
// the bits of ps_sgemm followed by silu_mul.  Returns 0 where it cannot (not built, or
// I % 16 != 0).
int ps_sgemm_silu(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
                  float* y, int64_t ys, int nthreads) {
#if PS_SGEMM
  if (n % (2 * kNR) != 0) return 0;
  gemm(x, xs, m, k, wp, n, nullptr, y, ys, nthreads, true);
  return 1;
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)y, (void)ys, (void)nthreads;
  return 0;
#endif
}

// Float32 x and y over a weight held in bf16: a bf16 checkpoint run in float32, whose
// float32 weights are bf16 values exactly.  Each weight is widened as it loads, so the
// sums are ps_sgemm's over the float32 weight, bit for bit, from half the bytes: decode
// steps stream the weights from memory, and this halves what they read.  The weight is
// ps_sgemm_bf16_pack's layout.
int64_t ps_sgemm_w16_packed_size(int64_t n, int64_t k) { return panels(n) * kNR * k; }

void ps_sgemm_w16(const float* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                  int64_t n, const float* bias, float* y, int64_t ys, int nthreads) {
#if PS_SGEMM
  gemm(x, xs, m, k, wp, n, bias, y, ys, nthreads);
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ys,
      (void)nthreads;
#endif
}

// Gated, as ps_sgemm_silu (the weight ps_sgemm_bf16_pack of the gated rows).
int ps_sgemm_w16_silu(const float* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                      int64_t n, float* y, int64_t ys, int nthreads) {
#if PS_SGEMM
  if (n % (2 * kNR) != 0) return 0;
  gemm(x, xs, m, k, wp, n, nullptr, y, ys, nthreads, true);
  return 1;
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)y, (void)ys, (void)nthreads;
  return 0;
#endif
}

// The same in bfloat16: x [m, k] and y [m, n] bf16, packed weight from ps_sgemm_bf16_pack,
// bias [n] float32 or null.  x is widened as it is packed and y computed in float32, then
// rounded to bf16 once (as a bf16 GEMM with float32 accumulation does).
void ps_sgemm_bf16(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                   int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads) {
#if PS_SGEMM
  if (m <= 0 || n <= 0) return;
  thread_local std::vector<float> ybuf;
  float* yf = scratch(ybuf, m * n);
  gemm(x, xs, m, k, wp, n, bias, yf, n, nthreads);
#pragma omp parallel for num_threads(std::max(1, nthreads)) schedule(static)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) y[r * ys + j] = to_bf16(yf[r * n + j]);
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ys,
      (void)nthreads;
#endif
}

}  // extern "C"
