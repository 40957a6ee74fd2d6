// Paged attention for decode queries on CPU: the entry points for float32 and bf16 caches,
// and the quantized caches' dispatch (the kernel and its notes: paged_decode.h).

#include "paged_decode.h"

extern "C" {

int ps_max_group() { return kMaxGroup; }
int ps_max_dim() { return kMaxDim; }
// 1 when bf16 decode runs on AVX-512 BF16 dot products (else the fp32 FMA path).
int ps_decode_bf16_dot() { return PS_DPBF16; }
// The variant this build compiled (gpu/cpu/features.py names the same ones): the vector
// width and the bf16 dot-product path follow the -march the library was built for.
const char* ps_isa() {
#if PS_DPBF16
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

// qs / os: token strides of q and out (elements); each token's heads x dim are dense.
void ps_decode_f32(const float* q, int64_t qs, const float* kc, const float* vc,
                   const int32_t* tables, int64_t tstride, const int32_t* lens, float* out,
                   int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                   int nthreads) {
  decode<float>(
      {q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, dim, bs, scale, qs, os},
      nthreads);
}

void ps_decode_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc,
                    const int32_t* tables, int64_t tstride, const int32_t* lens, uint16_t* out,
                    int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                    int nthreads) {
  decode<uint16_t>(
      {q, kc, vc, tables, tstride, lens, out, nseq, nheads, nkv, dim, bs, scale, qs, os},
      nthreads);
}

// Quantized cache (kind 0: int8, 1: fp8 e4m3) with per-(slot, kv head) scales ks / vs;
// q and out are bf16 when bf16 != 0, else fp32.
void ps_decode_quant(int kind, int bf16, const void* q, int64_t qs, const void* kc,
                     const void* vc, const uint16_t* ks, const uint16_t* vs,
                     const int32_t* tables, int64_t tstride, const int32_t* lens, void* out,
                     int64_t os, int nseq, int nheads, int nkv, int dim, int bs, float scale,
                     int nthreads) {
  (kind == 0 ? ps_paged_decode::quant_int8 : ps_paged_decode::quant_fp8)(
      bf16, q, qs, kc, vc, ks, vs, tables, tstride, lens, out, os, nseq, nheads, nkv, dim, bs,
      scale, nthreads);
}

}  // extern "C"
