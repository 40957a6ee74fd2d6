"""The CPU backend: what a step runs on a CPU instead of the Triton kernels.

- `features`: the CPU's ISA (AVX-512, bf16 dot products, AMX) and the dtype it computes
  natively.
- `kernels`: the compiled C++ kernels (paged attention, GEMMs, fused elementwise ops, the
  layer stack), built once per ISA, bound through typed ctypes declarations derived from
  `kernels/entry_points.h`.
- `linear`: projection weights packed once at load, one strategy per kernel family.
- `layer_stack`: a step's decoder layers in one compiled call.
- `threads`: the thread team from the CPUs this process may really use.
- `attention`: the attention backend on top of the kernels ("cpu").

The model (`gpu/model.py`) reaches this package only through the attention and linear
interfaces it calls on every device.
"""
