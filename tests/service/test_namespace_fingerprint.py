"""The prefix-tier namespace: replicas share KV only when the payload layout matches."""

import json

from service.engine_setup import namespace_fingerprint


def test_fingerprint_separates_payload_layouts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    fp = lambda **kw: namespace_fingerprint(tmp_path, "bfloat16", 16, **kw)  # noqa: E731
    plain = fp()
    assert plain == fp(), "the same replica config must map to the same namespace"
    kinds = {plain, fp(kv_cache_dtype="int8"), fp(kv_cache_dtype="fp8"), fp(quantization="int8")}
    assert len(kinds) == 4
    assert namespace_fingerprint(tmp_path, "float32", 16) != plain
    assert namespace_fingerprint(tmp_path, "bfloat16", 32) != plain
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128}))
    assert fp() != plain, "other weights/config, other namespace"
