"""GPU check: kernel tests at real sizes, kernel bandwidth/FLOP rates, end-to-end decode.

For a machine with a CUDA GPU (`make gpu-check`, i.e. `python -m bench.gpu_check`); the
whole run takes about five minutes on an H200.  Four independent parts, each
guarded so one failing part still leaves the others' rows in the table:

1. tests    pytest on tests/gpu/test_kernels.py + test_triton_backend.py, natively, with
            PAGESTREAM_GPU_CHECK=1 (real sizes); pass/fail/skip counts.
2. kernels  device copy bandwidth; each attention kernel's achieved bandwidth (bytes of
            K/V/Q/O it must move / time) as a fraction of it; split vs non-split decode;
            prefill TFLOP/s against torch SDPA; a small tile-config sweep; fused RMSNorm and
            rotary against their torch versions.
3. e2e      decode tokens/s of a random ~1B Llama-shaped model through gpu.model_runner at
            batch 1 and 64, eager and (when the runner offers them) with CUDA graphs,
            against the roofline of reading the weights (+ KV) once per step; a prefill
            step and a mixed step (decodes beside a new prompt) per mode; then a batch-64
            decode step's period through the whole engine (`LLM`, the served bench's 1B
            checkpoint) with async scheduling and without, beside the decode graph's
            replay (issue 47's bar: within 10%).
4. engine   pytest on the engine's parity with transformers and the server's API tests
            (OpenAI client, WebSocket, structured output, speculation, quantization) with
            the engine on the device; one row per file.  Needs the test extras (openai,
            websockets, jsonschema, pytest-asyncio, transformers); says so when missing.

Writes one markdown table to $OUT/gpu_check.md when $OUT is set, else
bench/results/gpu_check.md, and prints it.  `--device cpu` is a dry run of the harness at
toy sizes through Triton's interpreter (numbers meaningless; for checking the script).
"""
