"""TritonAttentionBackend against TorchAttentionBackend on identical metadata and caches,
and the backend factory.  CPU: Triton's interpreter (tests/conftest.py); CUDA: native."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from gpu.attention import (
    AttentionBackend,
    CpuAttentionBackend,
    TorchAttentionBackend,
    create_attention_backend,
)
from gpu.kernels._common import is_interpreted
from gpu.kernels.attention import _paged_attention_kernel, choose_num_splits
from gpu.kernels.testing import make_paged_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LARGE = DEVICE.type == "cuda" or os.environ.get("PAGESTREAM_GPU_CHECK") == "1"

if DEVICE.type == "cpu" and not is_interpreted(_paged_attention_kernel):
    pytest.skip(
        "no CUDA and the kernels are compiled (TRITON_INTERPRET unset)", allow_module_level=True
    )

from gpu.attention.triton_backend import TritonAttentionBackend  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOL = {F32: (1e-4, 1e-4), F16: (4e-3, 4e-3), BF16: (2.5e-2, 2e-2)}

# (id, query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
#  num_decodes, backend num_splits)
CASES = [
    ("decode-gqa-bf16", (1,) * 5, (0, 15, 16, 33, 200), 8, 2, 64, 16, BF16, None, None),
    ("mixed-chunked-f32", (1, 1, 24, 9), (40, 7, 0, 50), 4, 4, 128, 32, F32, None, None),
    ("mixed-mqa-f16", (1, 1, 1, 17), (31, 32, 3, 16), 8, 1, 64, 16, F16, 2, None),
    ("prefill-gqa8-bf16", (40, 12), (0, 100), 16, 2, 128, 16, BF16, None, None),
    ("decode-split-forced-bf16", (1,) * 3, (5, 130, 290), 8, 2, 128, 16, BF16, None, 4),
    ("mixed-split-forced-f32", (1, 1, 10), (64, 99, 20), 4, 2, 64, 32, F32, None, 3),
    # decode-only and long enough for the heuristic to split on its own
    ("decode-heuristic-split-f32", (1, 1), (1100, 700), 4, 2, 64, 16, F32, None, None),
]
if LARGE:
    CASES += [
        (
            "large-decode-bf16",
            (1,) * 64,
            tuple(1 + (i * 2654435761) % 8191 for i in range(64)),
            32,
            8,
            128,
            16,
            BF16,
            None,
            None,
        ),
        (
            "large-mixed-bf16",
            (*(1,) * 16, 512, 200),
            (*(1 + (i * 977) % 4095 for i in range(16)), 0, 3000),
            32,
            8,
            128,
            16,
            BF16,
            None,
            None,
        ),
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_triton_matches_torch_backend(case: tuple) -> None:  # type: ignore[type-arg]
    cid, qlens, ctxs, heads, kv_heads, head_dim, block_size, dtype, nd, splits = case
    # Finite garbage in unused slots: the torch path multiplies masked-out (zero) weights
    # by whatever lies past a sequence's end, which must not be NaN for it.
    b = make_paged_batch(
        qlens,
        ctxs,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        seed=zlib.crc32(cid.encode()),
        num_decodes=nd,
        poison=100.0,
    )
    scale = head_dim**-0.5
    torch_be = TorchAttentionBackend(heads, kv_heads, head_dim, scale)
    triton_be = TritonAttentionBackend(heads, kv_heads, head_dim, scale, num_splits=splits)
    k_cache_t, v_cache_t = b.k_cache.clone(), b.v_cache.clone()
    k_cache_2, v_cache_2 = b.k_cache.clone(), b.v_cache.clone()

    ref = torch_be.forward(b.q, b.k, b.v, k_cache_t, v_cache_t, b.meta)
    out = triton_be.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta)
    # The backend checks its arguments on the first call only; the second, unchecked
    # launch derives the same sizes and computes the same bits (into `out` when given).
    buf = torch.full_like(b.q, float("nan"))
    again = triton_be.forward(b.q, b.k, b.v, k_cache_2, v_cache_2, b.meta, out=buf)
    assert again is buf

    assert torch.equal(b.k_cache, k_cache_t) and torch.equal(b.v_cache, v_cache_t), cid
    assert torch.equal(k_cache_2, b.k_cache) and torch.equal(v_cache_2, b.v_cache), cid
    assert torch.equal(again, out), cid
    k_cache_3, v_cache_3 = k_cache_t.clone(), v_cache_t.clone()
    buf = torch.full_like(b.q, float("nan"))
    assert torch_be.forward(b.q, b.k, b.v, k_cache_3, v_cache_3, b.meta, out=buf) is buf
    assert torch.equal(buf, ref), cid
    assert out.shape == b.q.shape and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        out.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda s: f"{cid}: {s}"
    )


def test_first_call_checks_arguments() -> None:
    b = make_paged_batch(
        (1, 3), (4, 0), num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=F32, device=DEVICE, seed=1,
    )  # fmt: skip
    be = TritonAttentionBackend(4, 2, 64, 0.125)
    b.meta.slot_mapping = b.meta.slot_mapping.to(torch.int32)
    for _ in range(2):  # a first call that failed checks the next one too
        with pytest.raises(ValueError, match="slot_mapping"):
            be.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta)


def test_heuristic_case_really_splits() -> None:
    # Keeps "decode-heuristic-split-f32" honest: on this device's SM count it must split.
    from gpu.kernels.attention import _sm_count

    if DEVICE.type == "cuda":
        pytest.skip("the CPU case is sized for the interpreter's nominal SM count")
    assert choose_num_splits(2, 2, 2, 1101, _sm_count(DEVICE)) > 1


# --------------------------------------------------------------------------- factory


def make(name: str, device: torch.device | str = DEVICE, **kw: object) -> AttentionBackend:
    args: dict[str, object] = dict(
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        scale=0.125,
        dtype=torch.bfloat16,
        block_size=16,
    )
    args.update(kw)
    return create_attention_backend(name, device, **args)  # type: ignore[arg-type]


def test_factory_names() -> None:
    assert isinstance(make("torch"), TorchAttentionBackend)
    assert make("torch").name == "torch"
    assert isinstance(make("triton"), TritonAttentionBackend)
    assert make("triton").name == "triton"
    auto = make("auto")
    expected = TritonAttentionBackend if DEVICE.type == "cuda" else CpuAttentionBackend
    assert type(auto) is expected
    assert type(make("auto", "cpu")) is CpuAttentionBackend
    assert make("cpu", "cpu").name == "cpu"
    # the plain torch path is its own backend on a CPU too (the kernels' reference)
    assert type(make("torch", "cpu")) is TorchAttentionBackend
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="needs a CPU device"):
            make("cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        make("flash")


def test_factory_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make("triton", "cpu")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(head_dim=96), "head_dim 96 is not supported"),
        (dict(dtype=torch.float64), r"dtype torch\.float64 is not supported"),
        (dict(block_size=8), "block_size 8 is not supported"),
        (dict(num_kv_heads=3), "not a multiple of num_kv_heads 3"),
    ],
)
def test_factory_rejects_unsupported(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make("triton", **kw)


def test_check_supported_names_the_value() -> None:
    check = TritonAttentionBackend.check_supported
    check(128, torch.bfloat16, 32)  # supported: no error
    with pytest.raises(ValueError, match="head_dim 80"):
        check(80, torch.float16, 16)
    with pytest.raises(ValueError, match=r"dtype torch\.int8"):
        check(64, torch.int8, 16)
    with pytest.raises(ValueError, match="block_size 64"):
        check(64, torch.float32, 64)


def test_auto_falls_back_to_torch_when_triton_cannot_run_it() -> None:
    be = make("auto", head_dim=96)
    # On CUDA the portable torch path; a CPU's auto is the CPU backend whatever Triton takes.
    assert type(be) is (TorchAttentionBackend if DEVICE.type == "cuda" else CpuAttentionBackend)
