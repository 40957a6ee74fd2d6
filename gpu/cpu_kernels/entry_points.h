// The entry points layer_stack.cpp calls across files, declared once: each defining file
// includes this header too, so a changed signature fails to compile instead of being
// called with the old one.

#pragma once

#include <cstdint>

extern "C" {
void ps_add_rms_norm(int bf16, const void* x, int64_t xs, void* res, int64_t rs, const void* w,
                     void* out, int64_t os, int rows, int dim, float eps, int nthreads);
void ps_rope(int bf16, void* q, int64_t qs, int hq, void* k, int64_t ks, int hk,
             const int64_t* pos, const float* cos, const float* sin, int rows, int dim,
             int nthreads);
void ps_write_kv(int kind, int bf16, const void* k, int64_t ks, const void* v, int64_t vs,
                 void* kc, void* vc, uint16_t* ksc, uint16_t* vsc, const int64_t* slots,
                 int ntok, int nkv, int dim, int nthreads);
void ps_decode_f32(const float* q, int64_t qs, const float* kc, const float* vc,
                   const int32_t* tables, int64_t tstride, const int32_t* lens, float* out,
                   int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                   int nthreads);
void ps_decode_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc,
                    const int32_t* tables, int64_t tstride, const int32_t* lens, uint16_t* out,
                    int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                    int nthreads);
void ps_prefill_f32(const float* q, int64_t q_stride, const float* kc, const float* vc,
                    const int32_t* tables, int64_t tstride, const int32_t* qsl,
                    const int32_t* seq_lens, float* out, int64_t out_stride, int nseq, int nheads,
                    int nkv, int dim, int bs, float scale, int nthreads, const int64_t* tree);
void ps_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* kc, const uint16_t* vc,
                     const int32_t* tables, int64_t tstride, const int32_t* qsl,
                     const int32_t* seq_lens, uint16_t* out, int64_t out_stride, int nseq,
                     int nheads, int nkv, int dim, int bs, float scale, int nthreads,
                     const int64_t* tree);
void ps_dpbf16(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
               int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads);
int ps_dpbf16_silu(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                   int64_t n, uint16_t* y, int64_t ys, int nthreads);
void ps_sgemm512(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
                 const float* bias, float* y, int64_t ys, int nthreads);
int ps_sgemm512_silu(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp,
                     int64_t n, float* y, int64_t ys, int nthreads);
void ps_sgemm(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
              const float* bias, float* y, int64_t ys, int nthreads);
int ps_sgemm_silu(const float* x, int64_t xs, int64_t m, int64_t k, const float* wp, int64_t n,
                  float* y, int64_t ys, int nthreads);
void ps_amx_gemm(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                 int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads);
int ps_amx_silu(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                int64_t n, uint16_t* y, int64_t ys, int nthreads);
}
