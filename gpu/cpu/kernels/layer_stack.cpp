// A step's decoder layers in one call: for each layer the residual add and RMSNorm, the
// qkv projection, rotary, the K/V store, paged attention (the decode rows, then every
// prompt chunk), o_proj, the second add + RMSNorm, the gated gate_up (SiLU·up as its
// epilogue) and down_proj; then the final add + norm.  Every call below is the one
// gpu/model.py's fused CPU path makes through ctypes, with the same arguments in the same
// order, so the result is the same bits.
//
// Why: that path crosses from Python to C ~9 times a layer.  Each crossing costs 10-20 us
// of interpreter work (argument checks, views, ctypes conversion) while the second core's
// OpenMP thread spins idle, and in the server every return from C takes the GIL back from
// the event loop's thread.  Timed on a 2-core Zen 4 EPYC (the `mid` model, 44-row decode
// steps): the Python forward 28.6-41.3 ms against 25.6-33.5 ms for the same 74 kernel calls
// replayed back to back; with the stack, decode steps 0.94x over the offline workload, and
// served alone at 8 req/s 1.10x the tokens with p50 TTFT 0.72x.
//
// Only pagestream's packed GEMMs, each with its gated form (vdpbf16ps in bf16, the AVX-512
// and AVX2 float32 sgemms, the latter also over weights held in bf16, AMX up to the rows
// it takes), an unquantized cache, every prompt chunk on the compiled prefill kernel and
// no per-head q/k norm; gpu/cpu/layer_stack.py decides when a step may come here.

#include <cstdint>
#include <cstring>
#include <vector>

#include "entry_points.h"
#include "gemm_common.h"

namespace {

// entry_points.h declares them (bindings.py derives gpu/cpu/layer_stack.py's ctypes
// structures from there).
using Layer = PsLayer;
using Step = PsStep;

// y = x . w^T (+ bias) on the step's kernel.
void gemm(const Step& s, const void* x, int64_t xs, int64_t k, const void* w, int64_t n,
          const float* bias, void* y) {
  switch (s.kind) {
    case 0:
      ps_dpbf16(static_cast<const uint16_t*>(x), xs, s.rows, k, static_cast<const uint16_t*>(w),
                n, bias, static_cast<uint16_t*>(y), n, s.nthreads);
      return;
    case 1:
      ps_sgemm512(static_cast<const float*>(x), xs, s.rows, k, static_cast<const float*>(w), n,
                  bias, static_cast<float*>(y), n, s.nthreads);
      return;
    case 3:
      ps_amx_gemm(static_cast<const uint16_t*>(x), xs, s.rows, k,
                  static_cast<const uint16_t*>(w), n, bias, static_cast<uint16_t*>(y), n,
                  s.nthreads);
      return;
    case 4:
      ps_sgemm_w16(static_cast<const float*>(x), xs, s.rows, k, static_cast<const uint16_t*>(w),
                   n, bias, static_cast<float*>(y), n, s.nthreads);
      return;
    default:
      ps_sgemm(static_cast<const float*>(x), xs, s.rows, k, static_cast<const float*>(w), n,
               bias, static_cast<float*>(y), n, s.nthreads);
  }
}

// y [rows, inter] = silu(x . gate^T) * (x . up^T); false where the kernel cannot.
bool gated(const Step& s, const void* x, const void* w, void* y) {
  const int64_t n = 2 * static_cast<int64_t>(s.inter);
  switch (s.kind) {
    case 0:
      return ps_dpbf16_silu(static_cast<const uint16_t*>(x), s.hidden, s.rows, s.hidden,
                            static_cast<const uint16_t*>(w), n, static_cast<uint16_t*>(y),
                            s.inter, s.nthreads) != 0;
    case 1:
      return ps_sgemm512_silu(static_cast<const float*>(x), s.hidden, s.rows, s.hidden,
                              static_cast<const float*>(w), n, static_cast<float*>(y), s.inter,
                              s.nthreads) != 0;
    case 3:
      return ps_amx_silu(static_cast<const uint16_t*>(x), s.hidden, s.rows, s.hidden,
                         static_cast<const uint16_t*>(w), n, static_cast<uint16_t*>(y), s.inter,
                         s.nthreads) != 0;
    case 4:
      return ps_sgemm_w16_silu(static_cast<const float*>(x), s.hidden, s.rows, s.hidden,
                               static_cast<const uint16_t*>(w), n, static_cast<float*>(y),
                               s.inter, s.nthreads) != 0;
    default:
      return ps_sgemm_silu(static_cast<const float*>(x), s.hidden, s.rows, s.hidden,
                           static_cast<const float*>(w), n, static_cast<float*>(y), s.inter,
                           s.nthreads) != 0;
  }
}

// Attention of q (rows qs elements apart) into o (rows os apart): the decode rows first,
// then every prefill chunk in one call, as the torch backend calls them when the kernel
// takes all chunks.
template <typename T, typename Decode, typename Prefill>
void attend(const Step& s, const Layer& L, const char* qv, int64_t qs, char* ov, int64_t os,
            Decode decode, Prefill prefill) {
  const int nd = s.decodes, np = s.seqs - s.decodes;
  const T* q = reinterpret_cast<const T*>(qv);
  T* o = reinterpret_cast<T*>(ov);
  const T *kc = static_cast<const T*>(L.k_cache), *vc = static_cast<const T*>(L.v_cache);
  if (nd)
    decode(q, qs, kc, vc, s.tables, s.tstride, s.lens, o, os, nd, s.heads, s.kv_heads,
           s.head_dim, s.block_size, s.scale, s.nthreads);
  if (np)
    prefill(q, qs, kc, vc, s.tables + nd * s.tstride, s.tstride, s.qsl + nd, s.lens + nd, o,
            os, np, s.heads, s.kv_heads, s.head_dim, s.block_size, s.scale, s.nthreads,
            nullptr);  // tree steps (Medusa verify) are not given to the stack
}

}  // namespace

extern "C" {

// Returns 0 when done; else 1 + the layer whose gated product the kernel refused (nothing
// after it was run: the caller's step fails).
int ps_layer_stack(const PsStep* step, const PsLayer* layers, int nlayers) {
  const Step& s = *step;
  const int bf16 = s.kind == 0 || s.kind == 3;
  const int64_t es = bf16 ? 2 : 4, t = s.rows, hid = s.hidden;
  const int64_t qsz = static_cast<int64_t>(s.heads) * s.head_dim;
  const int64_t kvsz = static_cast<int64_t>(s.kv_heads) * s.head_dim;
  const int64_t qkvw = qsz + 2 * kvsz;
  // The step's activations, one grow-only buffer per thread (each 64-byte aligned).
  const int64_t sizes[] = {t * hid, t * qkvw, t * qsz, t * hid, t * s.inter, t * hid};
  int64_t total = 0;
  for (int64_t n : sizes) total += (n * es + 63) / 64 * 64;
  thread_local std::vector<char> buf;
  char* p = ps::scratch(buf, total);
  char* bufs[6];
  for (int i = 0; i < 6; ++i) bufs[i] = p, p += (sizes[i] * es + 63) / 64 * 64;
  char *h = bufs[0], *qkv = bufs[1], *att = bufs[2], *a = bufs[3], *g = bufs[4], *m = bufs[5];
  const int nt = s.nthreads;
  // The last layer past its K/V store, for the kept rows only: the step's view of them.
  Step kept = s;
  if (s.nkeep >= 0) {
    kept.rows = s.nkeep;
    kept.tables = s.ktables, kept.lens = s.klens, kept.qsl = s.kqsl, kept.seqs = s.kseqs;
  }
  const void* add = nullptr;  // what the next norm adds into the residual first
  for (int l = 0; l < nlayers; ++l) {
    const Layer& L = layers[l];
    ps_add_rms_norm(bf16, add, hid, s.residual, s.rs, L.in_norm, h, hid, s.rows, s.hidden,
                    L.in_eps, nt);
    gemm(s, h, hid, hid, L.qkv, qkvw, L.qkv_bias, qkv);
    char* k = qkv + qsz * es;
    char* v = k + kvsz * es;
    ps_rope(bf16, qkv, qkvw, s.heads, k, qkvw, s.kv_heads, s.positions, s.cos, s.sin, s.rows,
            s.head_dim, nt);
    ps_write_kv(-1, bf16, k, qkvw, v, qkvw, L.k_cache, L.v_cache, nullptr, nullptr, s.slots,
                s.rows, s.kv_heads, s.head_dim, nt);
    const bool prune = s.nkeep >= 0 && l == nlayers - 1;
    if (prune) {
      // Every row's K/V is in the cache for later steps; nothing after this point reaches
      // another row's output, so the rows nobody reads stop here (a prompt chunk's rows
      // but its last: ~1/nlayers of a prompt's FLOPs).  Each row's sums are the same
      // whatever the batch (the kernels' contract), so the kept rows keep their bits.
      // Moved down in place: keep is ascending, so row keep[j] >= j is not yet overwritten.
      char* res = static_cast<char*>(s.residual);
      for (int j = 0; j < s.nkeep; ++j) {
        if (s.keep[j] == j) continue;
        std::memmove(qkv + j * qkvw * es, qkv + s.keep[j] * qkvw * es, qsz * es);
        std::memmove(res + j * s.rs * es, res + s.keep[j] * s.rs * es, hid * es);
      }
      if (s.nkeep == 0) return 0;  // K/V only: no row samples this step
    }
    const Step& c = prune ? kept : s;
    if (bf16)
      attend<uint16_t>(c, L, qkv, qkvw, att, qsz, ps_decode_bf16, ps_prefill_bf16);
    else
      attend<float>(c, L, qkv, qkvw, att, qsz, ps_decode_f32, ps_prefill_f32);
    gemm(c, att, qsz, qsz, L.o, hid, nullptr, a);
    ps_add_rms_norm(bf16, a, hid, s.residual, s.rs, L.post_norm, h, hid, c.rows, s.hidden,
                    L.post_eps, nt);
    if (!gated(c, h, L.gate_up, g)) return 1 + l;
    gemm(c, g, s.inter, s.inter, L.down, hid, nullptr, m);
    add = m;
  }
  ps_add_rms_norm(bf16, add, hid, s.residual, s.rs, s.final_norm, s.out, hid, kept.rows,
                  s.hidden, s.final_eps, nt);
  return 0;
}

}  // extern "C"
