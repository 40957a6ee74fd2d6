// Paged attention for decode queries on CPU.
//
// The torch path has to gather every sequence's scattered KV blocks into a padded dense
// tensor (and transpose it) before it can matmul; on a CPU with ~8 GB/s of memory
// bandwidth that copy costs several times the attention itself.  This kernel reads each
// K and V row once, straight from the paged cache, and never pads.
//
// Layout (as the Python side and the Triton kernels use it):
//   q, out       [num_seqs, num_heads, head_dim]              contiguous
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] contiguous
//   block_tables [num_seqs, table_stride] int32
//   seq_lens     [num_seqs] int32   (context length including the new token)
// One work item is (sequence, kv head): the query heads of a GQA group share every K/V
// row load.  Scores are kept for the whole context (plain softmax, not online), which
// is exact and cheap at the context lengths a CPU serves.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16 -> float: the high half of an fp32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // float -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

constexpr int kMaxGroup = 32;
constexpr int kMaxDim = 256;

// 16 floats: one AVX-512 register, or two AVX2 ones; GCC/Clang vector extensions keep
// this portable while giving the compiler no excuse not to vectorise.
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16f load16(const uint16_t* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float hsum(v16f v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Any head dimension, scalar loops (the compiler still vectorises them).
template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int32_t* tables, int64_t tstride,
            const int32_t* lens, T* out, int nseq, int nheads, int nkv, int dim, int bs,
            float scale, int nthreads) {
  const int group = nheads / nkv;
  const int64_t row = static_cast<int64_t>(nkv) * dim;  // elements per cache slot
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> scores;
    alignas(64) float qf[kMaxGroup][kMaxDim];
    alignas(64) float acc[kMaxGroup][kMaxDim];
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < nseq * nkv; ++item) {
      const int s = item / nkv, h = item % nkv;
      const int len = lens[s];
      const int32_t* table = tables + static_cast<int64_t>(s) * tstride;
      if (len <= 0) {
        for (int g = 0; g < group; ++g) {
          T* o = out + (static_cast<int64_t>(s) * nheads + h * group + g) * dim;
          for (int d = 0; d < dim; ++d) store(o + d, 0.0f);
        }
        continue;
      }
      scores.resize(static_cast<size_t>(group) * len);
      for (int g = 0; g < group; ++g) {
        const T* qs = q + (static_cast<int64_t>(s) * nheads + h * group + g) * dim;
        for (int d = 0; d < dim; ++d) qf[g][d] = load(qs[d]) * scale;
      }
      // Pass 1: scores, block by block.
      for (int t0 = 0; t0 < len; t0 += bs) {
        const int64_t base = static_cast<int64_t>(table[t0 / bs]) * bs * row + h * dim;
        const int n = len - t0 < bs ? len - t0 : bs;
        for (int j = 0; j < n; ++j) {
          const T* k = kc + base + j * row;
          alignas(64) float kf[kMaxDim];
          for (int d = 0; d < dim; ++d) kf[d] = load(k[d]);
          for (int g = 0; g < group; ++g) {
            float dot = 0.0f;
            for (int d = 0; d < dim; ++d) dot += qf[g][d] * kf[d];
            scores[static_cast<size_t>(g) * len + t0 + j] = dot;
          }
        }
      }
      // Pass 2: softmax weights (unnormalised) per head.
      float denom[kMaxGroup];
      for (int g = 0; g < group; ++g) {
        float* sc = scores.data() + static_cast<size_t>(g) * len;
        float m = sc[0];
        for (int t = 1; t < len; ++t) m = sc[t] > m ? sc[t] : m;
        float sum = 0.0f;
        for (int t = 0; t < len; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        denom[g] = sum;
        for (int d = 0; d < dim; ++d) acc[g][d] = 0.0f;
      }
      // Pass 3: weighted sum of V rows.
      for (int t0 = 0; t0 < len; t0 += bs) {
        const int64_t base = static_cast<int64_t>(table[t0 / bs]) * bs * row + h * dim;
        const int n = len - t0 < bs ? len - t0 : bs;
        for (int j = 0; j < n; ++j) {
          const T* v = vc + base + j * row;
          alignas(64) float vf[kMaxDim];
          for (int d = 0; d < dim; ++d) vf[d] = load(v[d]);
          for (int g = 0; g < group; ++g) {
            const float p = scores[static_cast<size_t>(g) * len + t0 + j];
            for (int d = 0; d < dim; ++d) acc[g][d] += p * vf[d];
          }
        }
      }
      for (int g = 0; g < group; ++g) {
        T* o = out + (static_cast<int64_t>(s) * nheads + h * group + g) * dim;
        const float inv = 1.0f / denom[g];
        for (int d = 0; d < dim; ++d) store(o + d, acc[g][d] * inv);
      }
    }
  }
}

// The same computation with the head dimension in C chunks of 16 floats (dim = 16 C).
// C is a compile-time constant so each query head's accumulators stay in registers.
template <typename T, int C>
void decode_vec(const T* q, const T* kc, const T* vc, const int32_t* tables, int64_t tstride,
                const int32_t* lens, T* out, int nseq, int nheads, int nkv, int bs, float scale,
                int nthreads) {
  constexpr int dim = 16 * C;
  const int group = nheads / nkv;
  const int64_t row = static_cast<int64_t>(nkv) * dim;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> scores;
    v16f qv[kMaxGroup][C];
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < nseq * nkv; ++item) {
      const int s = item / nkv, h = item % nkv;
      const int len = lens[s];
      const int32_t* table = tables + static_cast<int64_t>(s) * tstride;
      T* o0 = out + (static_cast<int64_t>(s) * nheads + h * group) * dim;
      if (len <= 0) {
        for (int i = 0; i < group * dim; ++i) store(o0 + i, 0.0f);
        continue;
      }
      scores.resize(static_cast<size_t>(group) * len);
      for (int g = 0; g < group; ++g) {
        const T* qs = q + (static_cast<int64_t>(s) * nheads + h * group + g) * dim;
        for (int c = 0; c < C; ++c) qv[g][c] = load16(qs + 16 * c) * scale;
      }
      // Pass 1: scores; each K row is converted once and used by every head of the group.
      for (int t0 = 0; t0 < len; t0 += bs) {
        const int64_t base = static_cast<int64_t>(table[t0 / bs]) * bs * row + h * dim;
        const int n = len - t0 < bs ? len - t0 : bs;
        for (int j = 0; j < n; ++j) {
          const T* k = kc + base + j * row;
          v16f kv[C];
          for (int c = 0; c < C; ++c) kv[c] = load16(k + 16 * c);
          for (int g = 0; g < group; ++g) {
            v16f a = qv[g][0] * kv[0];
            for (int c = 1; c < C; ++c) a += qv[g][c] * kv[c];
            scores[static_cast<size_t>(g) * len + t0 + j] = hsum(a);
          }
        }
      }
      // Pass 2 + 3, one head at a time so its accumulator lives in registers; the
      // group's V rows are re-read from L1/L2, not memory.
      for (int g = 0; g < group; ++g) {
        float* sc = scores.data() + static_cast<size_t>(g) * len;
        float m = sc[0];
        for (int t = 1; t < len; ++t) m = sc[t] > m ? sc[t] : m;
        float sum = 0.0f;
        for (int t = 0; t < len; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        v16f acc[C] = {};
        for (int t0 = 0; t0 < len; t0 += bs) {
          const int64_t base = static_cast<int64_t>(table[t0 / bs]) * bs * row + h * dim;
          const int n = len - t0 < bs ? len - t0 : bs;
          for (int j = 0; j < n; ++j) {
            const T* v = vc + base + j * row;
            const float p = sc[t0 + j];
            for (int c = 0; c < C; ++c) acc[c] += p * load16(v + 16 * c);
          }
        }
        const float inv = 1.0f / sum;
        T* o = o0 + g * dim;
        for (int c = 0; c < C; ++c) {
          v16f r = acc[c] * inv;
          for (int i = 0; i < 16; ++i) store(o + 16 * c + i, r[i]);
        }
      }
    }
  }
}

template <typename T>
void dispatch(const T* q, const T* kc, const T* vc, const int32_t* tables, int64_t tstride,
              const int32_t* lens, T* out, int nseq, int nheads, int nkv, int dim, int bs,
              float scale, int nthreads) {
  switch (dim) {
    case 32:
      return decode_vec<T, 2>(q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, bs,
                              scale, nthreads);
    case 64:
      return decode_vec<T, 4>(q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, bs,
                              scale, nthreads);
    case 128:
      return decode_vec<T, 8>(q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, bs,
                              scale, nthreads);
    case 256:
      return decode_vec<T, 16>(q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, bs,
                               scale, nthreads);
    default:
      return decode<T>(q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, dim, bs, scale,
                       nthreads);
  }
}

}  // namespace

extern "C" {

int ps_max_group() { return kMaxGroup; }
int ps_max_dim() { return kMaxDim; }

void ps_decode_f32(const float* q, const float* kc, const float* vc, const int32_t* tables,
                   int64_t tstride, const int32_t* lens, float* out, int nseq, int nheads,
                   int nkv, int dim, int bs, float scale, int nthreads) {
  dispatch<float>(q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, dim, bs, scale,
                  nthreads);
}

void ps_decode_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                    const int32_t* tables, int64_t tstride, const int32_t* lens, uint16_t* out,
                    int nseq, int nheads, int nkv, int dim, int bs, float scale, int nthreads) {
  dispatch<uint16_t>(q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, dim, bs, scale,
                     nthreads);
}

}  // extern "C"
