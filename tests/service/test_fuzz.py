"""Fuzzing the request schemas the server publishes at /openapi.json against a live
loopback server: bodies drawn from the schema (so they reach deep code), then mutated
(wrong types, unknown fields, arbitrary JSON).  Never a 5xx, never a hang, every error in
OpenAI's shape, and no KV block held afterwards."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from service.limits import Limits
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server
from tests.service.test_openai_api import post

FUZZ = settings(
    max_examples=40,
    deadline=None,  # each request has its own timeout below; a hang fails it
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_subnormal=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def from_schema(schema: dict[str, Any], comps: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that (mostly) satisfy a msgspec-generated JSON schema."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(comps[name], comps))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, comps) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if not props:
            return st.dictionaries(st.text(max_size=8), json_values, max_size=3)
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, comps) for k, v in props.items() if k in required},
            optional={k: from_schema(v, comps) for k, v in props.items() if k not in required},
        )
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {}), comps),
            min_size=schema.get("minItems", 0),
            max_size=max(3, schema.get("minItems", 0)),
        )
    if kind == "string":
        lo = schema.get("minLength", 0)
        return st.text(min_size=lo, max_size=max(lo, min(schema.get("maxLength", 16), 16)))
    if kind == "integer":
        lo = schema.get("minimum", -(2**31))
        hi = schema.get("maximum", lo + 2**40)
        return st.integers(lo, min(hi, lo + 64)) | st.integers(lo, hi)
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -1e9))
        exclusive = "exclusiveMinimum" in schema
        if exclusive and lo == 0:
            # Without subnormals the float just above 0 is the smallest normal one.
            lo, exclusive = sys.float_info.min, False
        return st.floats(
            lo,
            schema.get("maximum", 1e9),
            exclude_min=exclusive,
            allow_nan=False,
            # torch/oneDNN set flush-to-zero in this process; hypothesis refuses subnormals.
            allow_subnormal=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return json_values


def mutated(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    def mutate(draw_obj: tuple[Any, str, Any]) -> Any:
        obj, key, value = draw_obj
        if isinstance(obj, dict):
            return {**obj, key: value}
        return obj

    return st.one_of(
        valid,
        valid,
        st.tuples(valid, st.text(max_size=20), json_values).map(mutate),
        json_values,
    )


@pytest.fixture(scope="module")
def server():
    model = str(tiny_checkpoint("llama"))
    limits = Limits(template_timeout=5.0)
    with live_server(model, engine_kwargs={"max_model_len": 48}, limits=limits) as s:
        yield s


@pytest.fixture(scope="module")
def schemas(server) -> dict[str, Any]:
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=30) as r:
        return json.loads(r.read())


def body_strategy(schemas: dict[str, Any], path: str) -> st.SearchStrategy[Any]:
    comps = schemas["components"]["schemas"]
    op = schemas["paths"][path]["post"]
    return mutated(from_schema(op["requestBody"]["content"]["application/json"]["schema"], comps))


def check_http(server, path: str, body: Any) -> None:
    code, raw = post(server, path, json.dumps(body).encode())
    assert code < 500, (code, raw[:500], body)
    if code >= 400:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["type"], err


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/cache/prefixes",
        "/v1/conversations",
        "/v1/responses/input_tokens",
        "/tokenize",
        "/detokenize",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/invocations",
    ],
)
def test_fuzz_http(server, schemas, path):
    @FUZZ
    @given(body=body_strategy(schemas, path))
    def run(body: Any) -> None:
        check_http(server, path, body)

    run()
    server.wait_kv_free(30)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200


def test_fuzz_websocket(server, schemas):
    comps = schemas["components"]["schemas"]
    frames = st.lists(mutated(from_schema(comps["ClientFrame"], comps)), min_size=1, max_size=4)

    @settings(FUZZ, max_examples=25)
    @given(frames=frames)
    def run(frames: list[Any]) -> None:
        with connect(server.ws_url, open_timeout=30, close_timeout=10, max_size=None) as ws:
            for f in frames:
                ws.send(json.dumps(f))
            ws.send(json.dumps({"type": "ping"}))
            # The socket stays usable (the pong comes), and everything the frames started
            # answers without a 5xx until the socket goes quiet (generations are short).
            pong, deadline = False, time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    reply = json.loads(ws.recv(timeout=0.4 if pong else 30))
                except TimeoutError:
                    assert pong, "no pong within 30 s"
                    break
                pong = pong or reply["type"] == "pong"
                if reply["type"] == "error":
                    assert reply["code"] < 500, (reply, frames)
            else:
                raise AssertionError(f"the socket never went quiet: {frames}")
            # Closing the socket aborts whatever is left.

    run()
    server.wait_kv_free(30)
