// Paged prefill attention on CPU, flash-attention style.
//
// torch's CPU SDPA reaches ~80-140 GFLOP/s on prompt chunks (and with a context it first
// needs the request's blocks gathered into a dense copy plus a boolean mask).  This kernel
// reads K/V straight from the paged cache, never materialises the full score matrix, and
// keeps the hot loops register-blocked so that every vector load feeds many FMAs; one call
// handles every prefill chunk of a step (OpenMP over (request, kv head, position block)).
//
// Layout (the same as paged_decode.cpp):
//   q, out       [num_tokens, num_heads, head_dim]  (token stride given; heads contiguous)
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] contiguous
//   block_tables [num_seqs, table_stride] int32
//   qsl          [num_seqs + 1] int32, first q/out row of each request's chunk
//   seq_lens     [num_seqs] int32, context after the chunk (ctx = seq_len - chunk length)
// Query j of a chunk sits at position ctx + j and sees keys 0..ctx + j.
//
// Work item: (request, kv head, block of chunk positions).  Its "rows" are the block's
// positions x the kv head's G query heads, position-major, so short chunks still fill the
// vector lanes and every query head of a GQA group shares each K/V load.
//
// Scores are computed with the rows in vector lanes: the queries are transposed once per
// item into [dim][kW rows] panels, and each key element is broadcast from the cache row
// (no K packing at all).  That orientation makes the online softmax free of horizontal
// reductions: a row's running max and sum are just lanes.  P.V then runs with head-dim
// chunks in the lanes (probabilities broadcast), accumulating into an fp32 O tile that
// stays in L1.  Key tiles past a row block's last position are skipped; on the diagonal,
// micro-tiles and P.V row blocks only cover the keys their rows can see.
//
// bf16 inputs use AVX-512 BF16 dot products (vdpbf16ps: 32 multiply-adds per instruction,
// pairs of adjacent bf16 values) when the compiler targets them: queries are packed as
// (d, d+1) pairs, probabilities are rounded to bf16 (as GPU flash attention does) and V is
// interleaved as (key j, key j+1) pairs per key tile.  Everything else (fp32, bf16 on other
// CPUs, odd head dims) runs the fp32 FMA path written with GCC vector extensions of the
// native width (AVX-512, AVX2, SSE/NEON).  Any head dim works (padded to whole vectors).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "entry_points.h"
#include "simd.h"

namespace {

// One native vector of floats: its kW lanes hold kW query rows (scores, softmax) or kW
// head-dim values (P.V).  Wider-than-native GCC vectors compile to dreadful code.
using namespace ps;

#if defined(__AVX512F__)
// 32 vector registers: micro-tiles of 24 accumulators leave room for the operands.
constexpr int kQkVecs = 3;  // row vectors (kW rows each) per score micro-tile
constexpr int kQkKeys = 8;  // keys per score micro-tile
constexpr int kPvRows = 6;  // rows per P.V micro-tile
constexpr int kPvCols = 4;  // kW-wide head-dim chunks per P.V micro-tile
#else
// 16 vector registers: 12 accumulators.
constexpr int kQkVecs = 3;
constexpr int kQkKeys = 4;
constexpr int kPvRows = 4;
constexpr int kPvCols = 3;
#endif
// Keys per online-softmax step.  Larger tiles amortise the O rescale (a load, multiply and
// store of the accumulator tile) but waste more work on the causal diagonal.
constexpr int kTileKeys = 64;
static_assert(kTileKeys % kQkKeys == 0 && kTileKeys % 2 == 0, "tile must hold whole micro-tiles");
// Rows (positions x group heads) per work item: 3 AVX-512 vectors.  Enough rows to
// amortise loading K/V tiles, small enough to keep Q, S and O in L1 and give the threads
// many items to balance.
constexpr int kTargetRows = 48;
inline void from_f(float* p, float x) { *p = x; }
inline void from_f(uint16_t* p, float x) {  // float -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}


#if defined(__AVX512F__)
// In-register transpose of a 16x16 matrix of 32-bit elements: r[i] holds row i on entry,
// column i on exit.  Three rounds of unpacks and two of 128-bit lane shuffles.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // lane L of t[2i]: a[4L], b[4L], a[4L+1], b[4L+1]
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane L of r[4i+k]: column 4L+k of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of r[k], r[4+k], r[8+k], r[12+k]
    t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
  }
}
#endif

// ---- fp32 micro-kernels -------------------------------------------------------------

// Scores of NV row vectors against NK keys: s[j * rp + kW v + lane] = q_row . k_j.
// q: transposed panels [v][d][kW]; k: NK key rows (fp32).  Any head dim.
template <int NV, int NK>
struct QkF32 {
  static void run(const float* q, int dim, const float* const* k, float* s, int rp) {
    vf acc[NV][NK] = {};
    const float* kr[NK];
    for (int j = 0; j < NK; ++j) kr[j] = k[j];
    for (int d = 0; d < dim; ++d) {
      vf qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = *reinterpret_cast<const vf*>(q + (v * dim + d) * kW);
      for (int j = 0; j < NK; ++j) {
        const vf kb = bcast(kr[j][d]);
        for (int v = 0; v < NV; ++v) acc[v][j] += qv[v] * kb;
      }
    }
    for (int j = 0; j < NK; ++j)
      for (int v = 0; v < NV; ++v) *reinterpret_cast<vf*>(s + j * rp + kW * v) = acc[v][j];
  }
};

// o[r][c] = o[r][c] * alpha[r] + sum_j p[j][r] * v_j[c] for RB rows x CB kW-float chunks.
// o rows are dp floats apart; p is the [key][rp] probability tile (offset to row r0);
// vrow[j] + voff points at the chunk of key j's (fp32, padded) value row.
template <int NV, int>
struct QkF32Tile : QkF32<NV, kQkKeys> {};

template <int RB, int CB>
struct PvF32 {
  static void run(float* o, int dp, const float* alpha, const float* p, int rp,
                  const float* const* vrow, int voff, int nk) {
    vf acc[RB][CB];
    for (int r = 0; r < RB; ++r) {
      const vf a = bcast(alpha[r]);
      for (int c = 0; c < CB; ++c) acc[r][c] = *reinterpret_cast<vf*>(o + r * dp + kW * c) * a;
    }
    for (int j = 0; j < nk; ++j) {
      vf vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = loadv(vrow[j] + voff + kW * c);
      for (int r = 0; r < RB; ++r) {
        const vf pb = bcast(p[j * rp + r]);
        for (int c = 0; c < CB; ++c) acc[r][c] += pb * vv[c];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CB; ++c) *reinterpret_cast<vf*>(o + r * dp + kW * c) = acc[r][c];
  }
};

#if PS_DPBF16
// ---- AVX-512 BF16 micro-kernels -----------------------------------------------------

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }
inline __m512i bcast_pair(const uint16_t* p) {  // two adjacent bf16 as one 32-bit lane
  uint32_t u;
  std::memcpy(&u, p, 4);
  return _mm512_set1_epi32(static_cast<int>(u));
}

// As QkF32, with q panels of (d, d+1) bf16 pairs [v][pair][16] and bf16 key rows.
template <int NV, int NK>
struct QkDot {
  static void run(const uint32_t* q, int npair, const uint16_t* const* k, float* s, int rp) {
    __m512 acc[NV][NK];
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < NK; ++j) acc[v][j] = _mm512_setzero_ps();
    const uint16_t* kr[NK];
    for (int j = 0; j < NK; ++j) kr[j] = k[j];
    for (int i = 0; i < npair; ++i) {
      __m512bh qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = as_bh(_mm512_load_si512(q + (v * npair + i) * 16));
      for (int j = 0; j < NK; ++j) {
        const __m512bh kb = as_bh(bcast_pair(kr[j] + 2 * i));
        for (int v = 0; v < NV; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], qv[v], kb);
      }
    }
    for (int j = 0; j < NK; ++j)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(s + j * rp + kW * v, acc[v][j]);
  }
};

template <int NV, int>
struct QkDotTile : QkDot<NV, kQkKeys> {};

// As PvF32 over key pairs: pp[jp][r] holds (p[2jp][r], p[2jp+1][r]) as bf16, vp[jp][d]
// holds (v[2jp][d], v[2jp+1][d]); vp rows are dp pairs apart, pre-offset to the chunk.
template <int RB, int CB>
struct PvDot {
  static void run(float* o, int dp, const float* alpha, const uint32_t* pp, int rp,
                  const uint32_t* vp, int npair) {
    __m512 acc[RB][CB];
    for (int r = 0; r < RB; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o + r * dp + 16 * c), a);
    }
    for (int i = 0; i < npair; ++i) {
      __m512bh vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = as_bh(_mm512_load_si512(vp + i * dp + 16 * c));
      for (int r = 0; r < RB; ++r) {
        const __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(pp[i * rp + r])));
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < CB; ++c) _mm512_store_ps(o + r * dp + 16 * c, acc[r][c]);
  }
};

// Interleave two bf16 rows a, b (dim values each) into (a[d], b[d]) pairs, zero-padded
// to dp pairs.
inline void pack_v_pair(const uint16_t* a, const uint16_t* b, int dim, int dp, uint32_t* dst) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                  53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                  27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int d0 = 0; d0 < dp; d0 += 32) {
    const int n = dim - d0 < 32 ? dim - d0 : 32;
    const __mmask32 m = n >= 32 ? ~__mmask32{0} : ((__mmask32{1} << n) - 1);
    const __m512i va = _mm512_maskz_loadu_epi16(m, a + d0);
    const __m512i vb = _mm512_maskz_loadu_epi16(m, b + d0);
    _mm512_store_si512(dst + d0, _mm512_permutex2var_epi16(va, lo, vb));
    if (d0 + 16 < dp) _mm512_store_si512(dst + d0 + 16, _mm512_permutex2var_epi16(va, hi, vb));
  }
}

// Round two probability vectors (keys 2i and 2i+1, 16 rows) to bf16 and interleave them
// into one 32-bit (key pair) lane per row: the P operand of PvDot.
inline __m512i pack_p_pair(vf a, vf b) {
  alignas(64) static const uint16_t idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                               21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                               11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512bh ab = _mm512_cvtne2ps_pbh((__m512)b, (__m512)a);
  return _mm512_permutexvar_epi16(_mm512_load_si512(idx), (__m512i)ab);
}
#endif  // PS_DPBF16


// T: q and out (float or bf16 bits); C: cache values (T, or int8_t / fp8 with scales).
template <typename T, typename C = T>
struct Args {
  const T* q;
  int64_t q_stride;  // elements between consecutive tokens of q
  const C* kc;
  const C* vc;
  const int32_t* tables;
  int64_t tstride;
  const int32_t* qsl;
  const int32_t* seq_lens;
  T* out;
  int64_t out_stride;
  int nseq, nheads, nkv, dim, bs;
  float scale;
  const uint16_t* ks = nullptr;  // quantized: [num_blocks, bs, nkv] bf16 scales of kc / vc
  const uint16_t* vs = nullptr;
  // Tree attention (gpu/medusa.py): per query token (absolute row, like q), bit j set when
  // it may see its chunk's j-th key; keys before the chunk, and past 64, stay causal.
  const int64_t* tree = nullptr;
};

struct Item {
  int seq, head, p0, p1;  // chunk positions [p0, p1)
  int64_t cost;
};

// Per-thread scratch, sized once per call for the largest item.
struct Work {
  std::vector<vf> q, s, p, v, k, o, m, l, alpha, qpos, zero;
  Work(int nv, int dim, int dp) {
    const int c = dp / kW;
    q.resize(static_cast<size_t>(nv) * dim);  // fp32 panels, or bf16 pairs (half used)
    s.resize(static_cast<size_t>(kTileKeys) * nv);
    p.resize(static_cast<size_t>(kTileKeys / 2) * nv);
    v.resize(static_cast<size_t>(kTileKeys) * c);
    k.resize(static_cast<size_t>(kTileKeys) * c);
    o.resize(static_cast<size_t>(nv) * kW * c);
    m.resize(nv);
    l.resize(nv);
    alpha.resize(nv);
    qpos.resize(nv);
    zero.assign(c, vf{});
  }
};

template <typename T, typename C, bool kDot>
void run_item(const Args<T, C>& a, const Item& it, Work& w) {
  // Quantized caches are dequantized (value x its row's scale) as each tile's rows are
  // converted into the fp32 K and V panels below.
  constexpr bool kQuant = !std::is_same_v<C, T>;
  const int group = a.nheads / a.nkv, dim = a.dim, dp = (dim + kW - 1) / kW * kW, chunks = dp / kW;
  const int qlen = a.qsl[it.seq + 1] - a.qsl[it.seq];
  const int ctx = a.seq_lens[it.seq] - qlen;
  const int rows = (it.p1 - it.p0) * group, nv = (rows + kW - 1) / kW, rp = nv * kW;
  const int32_t* table = a.tables + static_cast<int64_t>(it.seq) * a.tstride;
  const int64_t slot = static_cast<int64_t>(a.nkv) * dim;  // elements per cache slot
  const int64_t tok0 = a.qsl[it.seq] + it.p0;
  const int head0 = it.head * group;
  const int64_t head_off = static_cast<int64_t>(it.head) * dim;
  auto q_row = [&](int r) {
    return a.q + (tok0 + r / group) * a.q_stride + static_cast<int64_t>(head0 + r % group) * dim;
  };

  float* qpos = reinterpret_cast<float*>(w.qpos.data());
  for (int r = 0; r < rp; ++r) qpos[r] = r < rows ? static_cast<float>(ctx + it.p0 + r / group) : 1e9f;
  // Transpose the queries into lane panels once; every key tile reuses them.
  [[maybe_unused]] const int npair = dim / 2;
#if defined(__AVX512F__)
  // 32-bit elements (fp32 values, or bf16 (d, d+1) pairs): 16x16 register transposes.
  if constexpr (kDot || std::is_same_v<T, float>) {
    int32_t* qp = reinterpret_cast<int32_t*>(w.q.data());
    const int n32 = kDot ? npair : dim;  // 32-bit elements per row
    for (int v = 0; v < nv; ++v) {
      for (int e0 = 0; e0 < n32; e0 += 16) {
        const int n = std::min(16, n32 - e0);
        const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xffffu : (1u << n) - 1);
        __m512i t[16];
        for (int i = 0; i < 16; ++i) {
          const int r = 16 * v + i;
          t[i] = r < rows ? _mm512_maskz_loadu_epi32(
                                m, reinterpret_cast<const char*>(q_row(r)) + 4 * e0)
                          : _mm512_setzero_si512();
        }
        transpose16(t);
        for (int k = 0; k < n; ++k) _mm512_store_si512(qp + (v * n32 + e0 + k) * 16, t[k]);
      }
    }
  } else
#endif
  {
    // Portable / bf16 -> fp32: one row at a time (there are no 32-bit pairs to gather).
    float* qp = reinterpret_cast<float*>(w.q.data());
    for (int r = 0; r < rp; ++r) {
      const T* src = r < rows ? q_row(r) : nullptr;
      float* dst = qp + (r / kW) * dim * kW + r % kW;
      for (int d = 0; d < dim; ++d) dst[d * kW] = src ? to_f(src[d]) : 0.0f;
    }
  }
  for (int v = 0; v < nv; ++v) {
    w.m[v] = bcast(kNeg);
    w.l[v] = vf{};
  }
  float* o = reinterpret_cast<float*>(w.o.data());
  std::fill(o, o + static_cast<size_t>(rows) * dp, 0.0f);

  const float c = a.scale * 1.4426950408889634f;  // softmax in base 2
  float* s = reinterpret_cast<float*>(w.s.data());
  float* alpha = reinterpret_cast<float*>(w.alpha.data());
  const C* zero_row = reinterpret_cast<const C*>(w.zero.data());
  const C* kptr[kTileKeys];
  const C* vptr[kTileKeys];
  float ksc[kTileKeys], vsc[kTileKeys];  // quantized: the tile's rows' scales
  const float* kf[kTileKeys];
  const float* vfp[kTileKeys];
  // Largest position among the rows of vector v (rows are position-major).
  auto vec_last = [&](int v) { return qpos[std::min(kW * v + kW - 1, rows - 1)]; };

  const int kend = ctx + it.p1;  // keys past the last row's position are never needed
  for (int k0 = 0; k0 < kend; k0 += kTileKeys) {
    const int nk = std::min(kTileKeys, kend - k0);
    const int nkc = (nk + kQkKeys - 1) / kQkKeys * kQkKeys;
    // Cache slots of the tile's keys; past the end, a zero row (no division per key).
    {
      int blk = k0 / a.bs, in = k0 % a.bs;
      for (int j = 0; j < nkc; ++j) {
        if (k0 + j < kend) {
          const int64_t sl = static_cast<int64_t>(table[blk]) * a.bs + in;
          const int64_t off = sl * slot + head_off;
          kptr[j] = a.kc + off;
          vptr[j] = a.vc + off;
          if constexpr (kQuant) {
            ksc[j] = to_f(a.ks[sl * a.nkv + it.head]);
            vsc[j] = to_f(a.vs[sl * a.nkv + it.head]);
          }
          if (++in == a.bs) {
            in = 0;
            ++blk;
          }
        } else {
          kptr[j] = vptr[j] = zero_row;
          ksc[j] = vsc[j] = 0.0f;
        }
      }
    }

    // 1. Scores, skipping micro-tiles whose keys all lie after the rows' positions.
    if constexpr (kDot) {
#if PS_DPBF16
      using Fn = void (*)(const uint32_t*, int, const uint16_t* const*, float*, int);
      static const auto tab = make_table<QkDotTile, kQkVecs, 1, Fn>();
      const uint32_t* qp = reinterpret_cast<const uint32_t*>(w.q.data());
      for (int v0 = 0; v0 < nv; v0 += kQkVecs) {
        const int n = std::min(kQkVecs, nv - v0);
        const float last = vec_last(v0 + n - 1);
        for (int j0 = 0; j0 < nkc && k0 + j0 <= last; j0 += kQkKeys)
          tab[n - 1](qp + v0 * npair * kW, npair, kptr + j0, s + j0 * rp + kW * v0, rp);
      }
#endif
    } else {
      const float* const* kr;
      if constexpr (!std::is_same_v<C, float>) {
        float* kb = reinterpret_cast<float*>(w.k.data());
        for (int j = 0; j < nkc; ++j) {
          if constexpr (kQuant) {
            const float sc = ksc[j];
            for (int d = 0; d < dim; ++d) kb[j * dp + d] = to_f(kptr[j][d]) * sc;
          } else {
            for (int d = 0; d < dim; ++d) kb[j * dp + d] = to_f(kptr[j][d]);
          }
          kf[j] = kb + j * dp;
        }
        kr = kf;
      } else {
        kr = reinterpret_cast<const float* const*>(kptr);
      }
      using Fn = void (*)(const float*, int, const float* const*, float*, int);
      static const auto tab = make_table<QkF32Tile, kQkVecs, 1, Fn>();
      const float* qp = reinterpret_cast<const float*>(w.q.data());
      for (int v0 = 0; v0 < nv; v0 += kQkVecs) {
        const int n = std::min(kQkVecs, nv - v0);
        const float last = vec_last(v0 + n - 1);
        for (int j0 = 0; j0 < nkc && k0 + j0 <= last; j0 += kQkKeys)
          tab[n - 1](qp + v0 * dim * kW, dim, kr + j0, s + j0 * rp + kW * v0, rp);
      }
    }

    // 2. Online softmax, lane-wise (one lane per row): mask, running max, rescale factor.
    const bool diag = k0 + nk - 1 > ctx + it.p0;  // some key lies after some row
    for (int v = 0; v < nv; ++v) {
      // Keys after this vector's last row are masked for all its rows: p = 0, no exp (and
      // the score micro-tiles may have skipped them).
      const int live = std::min(nk, static_cast<int>(vec_last(v)) - k0 + 1);
      if (a.tree) {
        for (int l = 0; l < kW && kW * v + l < rows; ++l) {
          const int64_t bits = a.tree[tok0 + (kW * v + l) / group];
          for (int j = 0; j < live; ++j) {
            const int rel = k0 + j - ctx;
            if (rel >= 0 && rel < 64 && !((bits >> rel) & 1)) s[j * rp + kW * v + l] = kNeg;
          }
        }
      }
      vf mt = bcast(kNeg);
      if (diag) {
        const vf pos = *reinterpret_cast<const vf*>(qpos + kW * v);
        for (int j = 0; j < live; ++j) {
          vf* sj = reinterpret_cast<vf*>(s + j * rp + kW * v);
          *sj = pos < bcast(static_cast<float>(k0 + j)) ? bcast(kNeg) : *sj;
          mt = vmax(mt, *sj);
        }
      } else {
        for (int j = 0; j < live; ++j) mt = vmax(mt, *reinterpret_cast<const vf*>(s + j * rp + kW * v));
      }
      const vf mnew = vmax(w.m[v], mt * c);
      const vf al = exp2v(w.m[v] - mnew);
      vf sum = vf{};
      if constexpr (kDot) {
#if PS_DPBF16
        // Straight into the bf16 pair layout PvDot reads; S is not written back.
        uint32_t* pp = reinterpret_cast<uint32_t*>(w.p.data()) + kW * v;
        const int npv = (nk + 1) / 2, nlive = live > 0 ? (live + 1) / 2 : 0;
        for (int i = 0; i < nlive; ++i) {
          const vf p0 = exp2v<3>(*reinterpret_cast<const vf*>(s + 2 * i * rp + kW * v) * c - mnew);
          const vf p1 = 2 * i + 1 < live ? exp2v<3>(*reinterpret_cast<const vf*>(s + (2 * i + 1) * rp + kW * v) * c - mnew) : vf{};
          sum += p0 + p1;
          _mm512_store_si512(pp + i * rp, pack_p_pair(p0, p1));
        }
        for (int i = nlive; i < npv; ++i) _mm512_store_si512(pp + i * rp, _mm512_setzero_si512());
#endif
      } else {
        for (int j = 0; j < nk; ++j) {
          vf* sj = reinterpret_cast<vf*>(s + j * rp + kW * v);
          const vf pj = j < live ? exp2v(*sj * c - mnew) : vf{};
          *sj = pj;
          sum += pj;
        }
      }
      w.l[v] = w.l[v] * al + sum;
      w.m[v] = mnew;
      *reinterpret_cast<vf*>(alpha + kW * v) = al;
    }

    // 3. O = O * alpha + P V, each row block only over the keys its rows can see (the
    // rest have p = 0 exactly).  A block that sees none keeps alpha == 1: skip it.
    if constexpr (kDot) {
#if PS_DPBF16
      const int npv = (nk + 1) / 2;
      const uint32_t* pp = reinterpret_cast<const uint32_t*>(w.p.data());
      uint32_t* vp = reinterpret_cast<uint32_t*>(w.v.data());
      for (int i = 0; i < npv; ++i) pack_v_pair(vptr[2 * i], vptr[2 * i + 1], dim, dp, vp + i * dp);
      using Fn = void (*)(float*, int, const float*, const uint32_t*, int, const uint32_t*, int);
      static const auto tab = make_table<PvDot, kPvRows, kPvCols, Fn>();
      for (int r0 = 0; r0 < rows; r0 += kPvRows) {
        const int nr = std::min(kPvRows, rows - r0);
        const int seen = ctx + it.p0 + (r0 + nr - 1) / group - k0 + 1;
        if (seen <= 0) continue;
        const int np = std::min(npv, (seen + 1) / 2);
        for (int c0 = 0; c0 < chunks; c0 += kPvCols) {
          const int nc = std::min(kPvCols, chunks - c0);
          tab[(nr - 1) * kPvCols + nc - 1](o + r0 * dp + kW * c0, dp, alpha + r0, pp + r0, rp,
                                           vp + kW * c0, np);
        }
      }
#endif
    } else {
      const float* const* vr;
      if constexpr (std::is_same_v<C, float>) {
        if (dim == dp) {
          vr = reinterpret_cast<const float* const*>(vptr);
        } else {
          float* vb = reinterpret_cast<float*>(w.v.data());
          for (int j = 0; j < nk; ++j) {
            std::memcpy(vb + j * dp, vptr[j], sizeof(float) * dim);
            std::fill(vb + j * dp + dim, vb + (j + 1) * dp, 0.0f);
            vfp[j] = vb + j * dp;
          }
          vr = vfp;
        }
      } else {
        float* vb = reinterpret_cast<float*>(w.v.data());
        for (int j = 0; j < nk; ++j) {
          if constexpr (kQuant) {
            const float sc = vsc[j];
            for (int d = 0; d < dim; ++d) vb[j * dp + d] = to_f(vptr[j][d]) * sc;
          } else {
            for (int d = 0; d < dim; ++d) vb[j * dp + d] = to_f(vptr[j][d]);
          }
          std::fill(vb + j * dp + dim, vb + (j + 1) * dp, 0.0f);
          vfp[j] = vb + j * dp;
        }
        vr = vfp;
      }
      using Fn = void (*)(float*, int, const float*, const float*, int, const float* const*,
                          int, int);
      static const auto tab = make_table<PvF32, kPvRows, kPvCols, Fn>();
      for (int r0 = 0; r0 < rows; r0 += kPvRows) {
        const int nr = std::min(kPvRows, rows - r0);
        const int seen = std::min(nk, ctx + it.p0 + (r0 + nr - 1) / group - k0 + 1);
        if (seen <= 0) continue;
        for (int c0 = 0; c0 < chunks; c0 += kPvCols) {
          const int nc = std::min(kPvCols, chunks - c0);
          tab[(nr - 1) * kPvCols + nc - 1](o + r0 * dp + kW * c0, dp, alpha + r0, s + r0, rp, vr,
                                           kW * c0, seen);
        }
      }
    }
  }

  const float* l = reinterpret_cast<const float*>(w.l.data());
  for (int r = 0; r < rows; ++r) {
    T* dst = a.out + (tok0 + r / group) * a.out_stride + static_cast<int64_t>(head0 + r % group) * dim;
    const float* src = o + static_cast<size_t>(r) * dp;
#if PS_DPBF16
    if constexpr (std::is_same_v<T, uint16_t>) {
      const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
      for (int d0 = 0; d0 < dim; d0 += 16) {
        const int n = std::min(16, dim - d0);
        const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xffffu : (1u << n) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(src + d0), inv));
        _mm256_mask_storeu_epi16(dst + d0, m, (__m256i)h);
      }
      continue;
    }
#endif
    const float inv = 1.0f / l[r];
    for (int d = 0; d < dim; ++d) from_f(dst + d, src[d] * inv);
  }
}

template <typename T, typename C = T>
void prefill(const Args<T, C>& a, int nthreads) {
  const int group = a.nheads / a.nkv;
  const int qb = std::max(1, kTargetRows / group);  // chunk positions per item
  std::vector<Item> items;
  for (int s = 0; s < a.nseq; ++s) {
    const int qlen = a.qsl[s + 1] - a.qsl[s];
    const int ctx = a.seq_lens[s] - qlen;
    for (int p0 = 0; p0 < qlen; p0 += qb) {
      const int p1 = std::min(qlen, p0 + qb);
      for (int h = 0; h < a.nkv; ++h)
        items.push_back({s, h, p0, p1, static_cast<int64_t>(ctx + p1) * (p1 - p0)});
    }
  }
  // Longest first, then dynamic scheduling: the causal triangle makes late blocks of a
  // chunk the most expensive, and this keeps the threads finishing together.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int dp = (a.dim + kW - 1) / kW * kW;
  const int nv = (qb * group + kW - 1) / kW;
  const int n = static_cast<int>(items.size());
  if (n == 0) return;
  constexpr bool kDotOk = PS_DPBF16 && std::is_same_v<T, uint16_t> && std::is_same_v<C, T>;
  const bool dot = kDotOk && a.dim % 2 == 0;
#pragma omp parallel num_threads(std::max(1, std::min(nthreads, n)))
  {
    Work w(nv, a.dim, dp);
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) {
      if (dot) {
        if constexpr (kDotOk) run_item<T, C, true>(a, items[i], w);
      } else {
        run_item<T, C, false>(a, items[i], w);
      }
    }
  }
}

}  // namespace

extern "C" {

// 1 when bf16 prefill runs on AVX-512 BF16 dot products (else the fp32 FMA path).
int ps_prefill_bf16_dot() { return PS_DPBF16; }

void ps_prefill_f32(const float* q, int64_t q_stride, const float* kc, const float* vc,
                    const int32_t* tables, int64_t tstride, const int32_t* qsl,
                    const int32_t* seq_lens, float* out, int64_t out_stride, int nseq, int nheads,
                    int nkv, int dim, int bs, float scale, int nthreads, const int64_t* tree) {
  prefill<float>({q, q_stride, kc, vc, tables, tstride, qsl, seq_lens, out, out_stride, nseq,
                  nheads, nkv, dim, bs, scale, nullptr, nullptr, tree},
                 nthreads);
}

void ps_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* kc, const uint16_t* vc,
                     const int32_t* tables, int64_t tstride, const int32_t* qsl,
                     const int32_t* seq_lens, uint16_t* out, int64_t out_stride, int nseq,
                     int nheads, int nkv, int dim, int bs, float scale, int nthreads,
                     const int64_t* tree) {
  prefill<uint16_t>({q, q_stride, kc, vc, tables, tstride, qsl, seq_lens, out, out_stride, nseq,
                     nheads, nkv, dim, bs, scale, nullptr, nullptr, tree},
                    nthreads);
}

// Quantized cache (kind 0: int8, 1: fp8 e4m3) with per-(slot, kv head) scales ks / vs;
// q and out are bf16 when bf16 != 0, else fp32.
void ps_prefill_quant(int kind, int bf16, const void* q, int64_t q_stride, const void* kc,
                      const void* vc, const uint16_t* ks, const uint16_t* vs, const int32_t* tables,
                      int64_t tstride, const int32_t* qsl, const int32_t* seq_lens, void* out,
                      int64_t out_stride, int nseq, int nheads, int nkv, int dim, int bs,
                      float scale, int nthreads, const int64_t* tree) {
  auto run = [&](auto tq, auto tc) {
    using T = decltype(tq);
    using C = decltype(tc);
    Args<T, C> a{static_cast<const T*>(q), q_stride, static_cast<const C*>(kc),
                 static_cast<const C*>(vc), tables, tstride, qsl, seq_lens,
                 static_cast<T*>(out), out_stride, nseq, nheads, nkv, dim, bs, scale, ks, vs,
                 tree};
    prefill<T, C>(a, nthreads);
  };
  if (bf16)
    kind == 0 ? run(uint16_t{}, int8_t{}) : run(uint16_t{}, fp8{});
  else
    kind == 0 ? run(float{}, int8_t{}) : run(float{}, fp8{});
}

}  // extern "C"
