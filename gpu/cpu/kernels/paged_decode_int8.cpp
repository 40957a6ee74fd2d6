// Paged decode attention over an int8 KV cache (the kernel: paged_decode.h; a file of
// its own so that a cold build compiles it beside the others).

#include "paged_decode.h"

namespace ps_paged_decode {

void quant_int8(int bf16, const void* q, int64_t qs, const void* kc, const void* vc,
                const uint16_t* ks, const uint16_t* vs, const int32_t* tables, int64_t tstride,
                const int32_t* lens, void* out, int64_t os, int nseq, int nheads, int nkv,
                int dim, int bs, float scale, int nthreads) {
  decode_quant<int8_t>(bf16, q, qs, kc, vc, ks, vs, tables, tstride, lens, out, os, nseq,
                       nheads, nkv, dim, bs, scale, nthreads);
}

}  // namespace ps_paged_decode
