// Every C entry point of the kernel library, and the structures they take, declared once.
//
// The one source of truth on both sides of the ctypes boundary:
// - C++: each defining file includes this header, so a definition that differs from its
//   declaration here fails to compile ("conflicting declaration of C function").
// - Python: gpu/cpu/kernels/bindings.py reads this file and derives every function's
//   ctypes argtypes/restype and every structure's ctypes fields from it;
//   tests/gpu/test_cpu_bindings.py checks what it derived against the compiler (sizeof,
//   offsetof and the type of every field and argument) and against the library's exports.
//
// So bindings.py can read it, keep to this form: one `type name` per parameter or field
// (`*` on the type), the types in bindings.py's table, no macros or default arguments.

#pragma once

#include <cstdint>

extern "C" {

// ---- layer_stack.cpp: a step's decoder layers in one call ------------------------------

// One decoder layer's weights and cache (a row of ps_layer_stack's table).
struct PsLayer {
  const void* in_norm;    // [hidden], the model's dtype
  const void* post_norm;  // [hidden]
  const void* qkv;        // packed [q + 2 kv, hidden]
  const float* qkv_bias;  // [q + 2 kv] float32, or null
  const void* o;          // packed [hidden, q]
  const void* gate_up;    // the gated pack of [2 inter, hidden]
  const void* down;       // packed [hidden, inter]
  void* k_cache;          // [blocks, block_size, kv_heads, head_dim]
  void* v_cache;
  float in_eps;
  float post_eps;
};

// One step: its shapes, metadata and buffers.
struct PsStep {
  int kind;  // 0: vdpbf16ps (bf16), 1: AVX-512 sgemm (float32), 2: AVX2 sgemm (float32), 3: AMX
            // (bf16), 4: AVX2 sgemm (float32, bf16 weights)
  int rows;
  int hidden;
  int heads;
  int kv_heads;
  int head_dim;
  int inter;
  int block_size;
  int nthreads;
  float scale;
  float final_eps;
  const int64_t* positions;  // [rows]
  const float* cos;          // [max_positions, head_dim / 2]
  const float* sin;
  const int64_t* slots;   // [rows]
  const int32_t* tables;  // [seqs, tstride]
  int64_t tstride;
  const int32_t* lens;  // [seqs]: context after the step
  const int32_t* qsl;   // [seqs + 1]: query_start_loc
  int seqs;
  int decodes;     // the first `decodes` sequences have one query row each
  void* residual;  // [rows, hidden] (row stride rs), updated in place
  int64_t rs;
  const void* final_norm;  // [hidden]
  void* out;  // [rows, hidden] (or [nkeep, hidden]), dense: the final norm's output
  // The rows the caller reads (ascending; nkeep -1: all).  Past the last layer's K/V store
  // only they go on (see ps_layer_stack), attended as the sequences below: each decode
  // row's own, then each kept prompt chunk's last row as a one-row chunk at the chunk's end.
  const int64_t* keep;
  int nkeep;
  const int32_t* ktables;  // [kseqs, tstride]
  const int32_t* klens;    // [kseqs]
  const int32_t* kqsl;     // [kseqs + 1]: 0, 1, ..., nkeep
  int kseqs;
};

// 0 when done; else 1 + the layer whose gated product the kernel refused.
int ps_layer_stack(const PsStep* step, const PsLayer* layers, int nlayers);

// ---- elementwise.cpp -------------------------------------------------------------------

void ps_add_rms_norm(int bf16, const void* x, int64_t xs, void* res, int64_t rs, const void* w,
                     void* out, int64_t os, int rows, int dim, float eps, int nthreads);
void ps_silu_mul(int bf16, const void* gu, int64_t gs, void* out, int64_t os, int rows,
                 int inter, int nthreads);
void ps_rope(int bf16, void* q, int64_t qs, int hq, void* k, int64_t ks, int hk,
             const int64_t* pos, const float* cos, const float* sin, int rows, int dim,
             int nthreads);

// ---- step_ops.cpp ----------------------------------------------------------------------

void ps_write_kv(int kind, int bf16, const void* k, int64_t ks, const void* v, int64_t vs,
                 void* kc, void* vc, uint16_t* ksc, uint16_t* vsc, const int64_t* slots,
                 int ntok, int nkv, int dim, int nthreads);
int64_t ps_gather_rows(const void* src, int64_t sr, int64_t nsrc, const int64_t* idx, int64_t n,
                       void* dst, int64_t row_bytes, int nthreads);
void ps_argmax(int bf16, const void* x, int64_t rs, int rows, int cols, int64_t* out,
               int nthreads);

// ---- paged_decode.cpp ------------------------------------------------------------------

int ps_max_group();
int ps_max_dim();
int ps_decode_bf16_dot();
const char* ps_isa();
void ps_decode_f32(const float* q, int64_t qs, const float* kc, const float* vc,
                   const int32_t* tables, int64_t tstride, const int32_t* lens, float* out,
                   int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                   int nthreads);
void ps_decode_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc,
                    const int32_t* tables, int64_t tstride, const int32_t* lens, uint16_t* out,
                    int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                    int nthreads);
void ps_decode_quant(int kind, int bf16, const void* q, int64_t qs, const void* kc,
                     const void* vc, const uint16_t* ks, const uint16_t* vs,
                     const int32_t* tables, int64_t tstride, const int32_t* lens, void* out,
                     int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                     int nthreads);

// ---- paged_prefill.cpp -----------------------------------------------------------------

int ps_prefill_bf16_dot();
void ps_prefill_f32(const float* q, int64_t q_stride, const float* kc, const float* vc,
                    const int32_t* tables, int64_t tstride, const int32_t* qsl,
                    const int32_t* seq_lens, float* out, int64_t out_stride, int nseq, int nheads,
                    int nkv, int dim, int bs, float scale, int nthreads, const int64_t* tree);
void ps_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* kc, const uint16_t* vc,
                     const int32_t* tables, int64_t tstride, const int32_t* qsl,
                     const int32_t* seq_lens, uint16_t* out, int64_t out_stride, int nseq,
                     int nheads, int nkv, int dim, int bs, float scale, int nthreads,
                     const int64_t* tree);
void ps_prefill_quant(int kind, int bf16, const void* q, int64_t q_stride, const void* kc,
                      const void* vc, const uint16_t* ks, const uint16_t* vs,
                      const int32_t* tables, int64_t tstride, const int32_t* qsl,
                      const int32_t* seq_lens, void* out, int64_t out_stride, int nseq,
                      int nheads, int nkv, int dim, int bs, float scale, int nthreads,
                      const int64_t* tree);

// ---- int8_gemv.cpp ---------------------------------------------------------------------

int ps_int8_lanes();
void ps_int8_pack(const int8_t* q, int64_t n, int64_t k, int8_t* out);
void ps_int8_unpack(const int8_t* packed, int64_t n, int64_t k, void* out, int out_bf16,
                    int nthreads);
void ps_int8_gemv(const void* x, int x_bf16, int64_t xs, int64_t m, int64_t k, const int8_t* q,
                  const float* scale, const void* bias, int bias_bf16, int64_t n, void* y,
                  int y_bf16, int64_t ys, int nthreads);

// ---- the packed GEMMs: ps_{name}_packed_size, ps_{name}_pack, ps_{name}, ps_{name}_silu --

int ps_sgemm_available();
int64_t ps_sgemm_packed_size(int64_t n, int64_t k);
void ps_sgemm_pack(const float* w, int64_t n, int64_t k, float* out, int nthreads);
void ps_sgemm(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
              const float* bias, float* y, int64_t ys, int nthreads);
int ps_sgemm_silu(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
                  float* y, int64_t ys, int nthreads);
int64_t ps_sgemm_bf16_packed_size(int64_t n, int64_t k);
void ps_sgemm_bf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads);
void ps_sgemm_bf16(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                   int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads);

int64_t ps_sgemm_w16_packed_size(int64_t n, int64_t k);
void ps_sgemm_w16(const float* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                  int64_t n, const float* bias, float* y, int64_t ys, int nthreads);
int ps_sgemm_w16_silu(const float* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                      int64_t n, float* y, int64_t ys, int nthreads);

int ps_amx_available();
int64_t ps_amx_gemm_packed_size(int64_t n, int64_t k);
void ps_amx_gemm_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads);
void ps_amx_gemm(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                 int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads);
int ps_amx_silu(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                int64_t n, uint16_t* y, int64_t ys, int nthreads);

int ps_dpbf16_available();
int ps_wide_l1();
int64_t ps_dpbf16_packed_size(int64_t n, int64_t k);
void ps_dpbf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads);
void ps_dpbf16(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
               int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads);
int ps_dpbf16_silu(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                   int64_t n, uint16_t* y, int64_t ys, int nthreads);

int ps_sgemm512_available();
int64_t ps_sgemm512_packed_size(int64_t n, int64_t k);
void ps_sgemm512_pack(const float* w, int64_t n, int64_t k, float* out, int nthreads);
void ps_sgemm512(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
                 const float* bias, float* y, int64_t ys, int nthreads);
int ps_sgemm512_silu(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp,
                     int64_t n, float* y, int64_t ys, int nthreads);
}
