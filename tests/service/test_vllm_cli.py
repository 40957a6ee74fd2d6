"""A `vllm serve` command line runs `pagestream serve` unchanged: the positional model,
`--config` YAML, `--speculative-config`, `--chat-template` (and its content format), TLS
and mutual TLS, a Unix socket, vLLM's response flags, SageMaker's /invocations and /ping,
and OpenAI's model retrieve — each through real clients on a real server process."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import transformers
import websockets

from scheduler.config import ConfigError
from service.chat_template import ChatTemplates, loops_over_content, sandbox
from service.cli import build_parser, main, server_config
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import server_process
from tests.tls_certs import Certs, make_certs

KEY = "vllm-key"
# A template that reads content as OpenAI's parts: "auto" must hand it a list of parts.
PARTS_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>"
    "{%- for p in m['content'] -%}{{ p['text'] }}{%- endfor -%}\n{% endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def _config(argv: list[str]) -> Any:
    return server_config(build_parser().parse_args(["serve", *argv]))


def _serve_args(argv: list[str]) -> Any:
    """`serve`'s flags as main() reads them, --config expanded."""
    from service.cli import _subparser
    from service.cli_config import expand_config_file

    ap = build_parser()
    return server_config(
        ap.parse_args(["serve", *expand_config_file(argv, _subparser(ap, "serve"))])
    )


@pytest.fixture(autouse=True)
def _no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PAGESTREAM_MODEL", "PAGESTREAM_API_KEY", "PAGESTREAM_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------- the command line
def test_root_path_is_the_documents_server() -> None:
    from service.openapi import openapi_document

    assert _config(["--root-path", "/llm"]).root_path == "/llm"
    assert openapi_document("/llm")["servers"] == [{"url": "/llm"}]


def test_a_vllm_serve_line_is_read_as_vllm_reads_it() -> None:
    c = _config([
        "/models/llama", "--host", "127.0.0.1", "--port", "8001", "--dtype", "auto",
        "--max-model-len", "256", "--served-model-name", "llama", "chat", "--api-key", KEY,
        "--enable-prefix-caching", "--enable-chunked-prefill", "--trust-remote-code",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--disable-log-requests", "--disable-log-stats", "--disable-uvicorn-access-log",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 5}',
        "--return-tokens-as-token-ids", "--enable-force-include-usage",
        "--response-role", "bot", "--no-enable-prefix-caching", "--disable-fastapi-docs",
    ])  # fmt: skip
    assert c.engine.model.model == "/models/llama" and c.port == 8001
    assert c.served_model_name == ["llama", "chat"] and c.api_keys == [KEY]
    spec = c.engine.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    assert c.return_tokens_as_token_ids and c.enable_force_include_usage
    assert c.response_role == "bot" and not c.access_log and not c.openapi_docs
    assert not c.engine.cache.enable_prefix_caching and c.tool_call_parser == "hermes"


def test_the_positional_model_and_model_flag_must_agree() -> None:
    assert _config(["/m", "--model", "/m"]).engine.model.model == "/m"
    with pytest.raises(ConfigError, match="name different models"):
        _config(["/m", "--model", "/other"])


def test_speculative_config_is_checked_and_not_mixed_with_the_flags() -> None:
    with pytest.raises(ConfigError, match=r"--speculative-config.*unknown speculative_config"):
        _config(["--speculative-config", '{"method": "ngram", "k": 3}'])
    with pytest.raises(ConfigError, match="give one form"):
        _config(["--speculative-config", '{"method": "ngram"}', "--speculative-method", "ngram"])
    draft = _config(["--speculative-config", '{"method": "draft_model", "model": "/d"}'])
    assert (draft.engine.speculative.method, draft.engine.speculative.model) == ("draft", "/d")


def test_config_file_flags_with_the_command_line_winning(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "model: /from/file\nport: 6379\nmax_model_len: 128\nserved-model-name: [a, b]\n"
        "api-key: [k1, k2]\nenable-prefix-caching: true\nno-prefix-caching: false\n"
        "engine-process: off\noverride-generation-config: {temperature: 0.5}\n"
        "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n"
    )
    c = _serve_args(["--config", str(cfg), "--port", "8002"])
    assert c.port == 8002 and c.engine.model.model == "/from/file"
    assert c.engine.model.max_model_len == 128 and c.served_model_name == ["a", "b"]
    assert c.api_keys == ["k1", "k2"] and c.engine.cache.enable_prefix_caching
    assert c.engine.device.engine_process is False and c.override_generation_config == {
        "temperature": 0.5
    }
    assert c.engine.speculative.num_speculative_tokens == 2
    # The positional model and a repeated flag given on the line replace the file's.
    c = _serve_args([f"--config={cfg}", "/from/line", "--api-key", "k3"])
    assert c.engine.model.model == "/from/line" and c.api_keys == ["k3"]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("max-modle-len: 128\n", "'max-modle-len' is not a flag of pagestream serve"),
        ("trust-remote-code: 1\n", "--trust-remote-code is a switch"),
        ("port: [1, 2]\n", "--port takes one value"),
        ("- port\n", "expected a mapping"),
        ("port: [unclosed\n", "--config"),
    ],
)
def test_a_bad_config_file_is_an_error_naming_what(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, error: str
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(cfg)])
    assert e.value.code == 2 and error in capsys.readouterr().err


def test_refused_at_start_naming_the_flag(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "tls")
    for argv, error in [
        (["--chat-template", "no/such/file.jinja"], "no such file, and not a Jinja template"),
        (["--chat-template", "{% for %}"], "does not compile"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
        (["--ssl-certfile", str(certs.server_cert)], "go together"),
        (["--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.client_key)],
         "--ssl-certfile / --ssl-keyfile"),
        (["--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
          "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        (["--ssl-ca-certs", str(certs.ca)], "need --ssl-certfile"),
        (["--max-log-len", "-1"], "--max-log-len must be >= 0"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as e:
            _config(argv)
        assert error in str(e.value), (argv, e.value)


# ------------------------------------------------------------------- content format
@pytest.mark.parametrize(
    ("template", "loops"),
    [
        (PARTS_TEMPLATE, True),
        ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
         True),
        ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', "
         "'text') %}{{ p.text }}{% endfor %}{% endfor %}", True),
        ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}"
         "{% endfor %}", False),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    ],
)  # fmt: skip
def test_auto_detects_a_template_that_reads_content_parts(template: str, loops: bool) -> None:
    assert loops_over_content(sandbox().parse(template)) is loops


def test_each_content_format_renders_as_transformers_does_given_that_shape() -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        msgs[1],
    ]
    as_text = [msgs[0], {"role": "user", "content": "a\nb"}]
    plain = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    for fmt, template, shape in [
        ("auto", PARTS_TEMPLATE, as_parts),
        ("openai", PARTS_TEMPLATE, as_parts),
        ("auto", plain, as_text),
        ("string", plain, as_text),
        ("openai", plain, as_parts),
    ]:
        ours = ChatTemplates(template, content_format=fmt).render(msgs)
        ref = hf.apply_chat_template(shape, chat_template=template, tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
        assert ours == ref, (fmt, template)


# ------------------------------------------------------------------- live servers
def _client_tls(certs: Certs, with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if with_cert:
        ctx.load_cert_chain(certs.client_cert, certs.client_key)
    return ctx


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server started by a vLLM-style line: positional model, flags from a YAML file,
    TLS, a chat template file, two served names."""
    tmp = tmp_path_factory.mktemp("vllm-line")
    certs = make_certs(tmp / "tls")
    template = tmp / "template.jinja"
    template.write_text(PARTS_TEMPLATE)
    cfg = tmp / "config.yaml"
    cfg.write_text(
        f"served-model-name: [chat, alias]\nchat-template: {template}\n"
        "return-tokens-as-token-ids: true\nenable-force-include-usage: true\n"
        "response-role: bot\nmax-model-len: 256\nnum-kv-blocks: 64\n"
        f"api-key: {KEY}\nssl-certfile: {certs.server_cert}\nssl-keyfile: {certs.server_key}\n"
    )
    model = tiny_checkpoint("llama")
    with server_process(
        tmp, "service.cli", str(model), "--config", str(cfg), "--dtype", "float32",
        tls=_client_tls(certs),
    ) as (_, url):  # fmt: skip
        yield url, certs, model


def _openai(url: str, certs: Certs) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=KEY, max_retries=0,
        http_client=httpx.Client(verify=_client_tls(certs), timeout=60),
    )  # fmt: skip


def test_chat_over_tls_with_the_servers_template_role_and_labels(tls_server: Any) -> None:
    url, certs, model = tls_server
    client = _openai(url, certs)
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(
        model="alias", messages=messages, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    hf = transformers.AutoTokenizer.from_pretrained(model)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    ref = hf.apply_chat_template(parts, chat_template=PARTS_TEMPLATE, add_generation_prompt=True)
    ids = ref["input_ids"] if isinstance(ref, dict | transformers.BatchEncoding) else ref
    assert r.usage.prompt_tokens == len(ids)
    choice = r.choices[0]
    assert choice.message.role == "bot" and r.model == "alias"
    lps = choice.logprobs.content
    assert len(lps) == 4 and all(lp.token.startswith("token_id:") for lp in lps)
    assert all(t.token.startswith("token_id:") for lp in lps for t in lp.top_logprobs)
    # The prompt /tokenize renders is the one transformers renders with that template.
    tok = httpx.post(
        url + "/tokenize", json={"model": "chat", "messages": messages},
        headers={"Authorization": f"Bearer {KEY}"}, verify=_client_tls(certs), timeout=30,
    ).json()  # fmt: skip
    assert tok["tokens"] == list(ids)


def test_a_stream_ends_with_usage_unasked_and_the_models_retrieve(tls_server: Any) -> None:
    url, certs, _ = tls_server
    client = _openai(url, certs)
    chunks = list(
        client.completions.create(
            model="chat", prompt="one two", max_tokens=3, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert client.models.retrieve("alias").id == "alias"
    assert {m.id for m in client.models.list()} >= {"chat", "alias"}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["param"] == "model"  # type: ignore[index]


def test_websocket_over_wss(tls_server: Any) -> None:
    url, certs, _ = tls_server

    async def go() -> list[dict[str, Any]]:
        ws_url = url.replace("https://", "wss://") + f"/v1/ws?api_key={KEY}"
        async with websockets.connect(ws_url, ssl=_client_tls(certs)) as ws:
            await ws.send(json.dumps({
                "type": "generate", "id": "g", "prompt": "one two",
                "params": {"max_tokens": 3, "temperature": 0, "ignore_eos": True},
            }))  # fmt: skip
            frames = []
            while not frames or frames[-1]["type"] != "done":
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return frames

    frames = asyncio.run(go())
    assert frames[-1]["type"] == "done" and any(f["type"] == "delta" for f in frames)


def test_invocations_and_ping(tls_server: Any) -> None:
    url, certs, _ = tls_server
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, verify=_client_tls(certs), timeout=60) as http:
        assert http.get("/ping").status_code == 200  # no key: a health check
        assert http.post("/ping").status_code == 200
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}  # fmt: skip
        assert http.post("/invocations", json=body).status_code == 401
        chat = http.post("/invocations", json=body, headers=auth).json()
        assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
        done = http.post(
            "/invocations", json={"prompt": "one", "max_tokens": 2}, headers=auth
        ).json()
        assert done["object"] == "text_completion"
        bad = http.post("/invocations", json={"nothing": 1}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        junk = http.post("/invocations", content=b"[1,", headers=auth)
        assert junk.status_code == 400 and "error" in junk.json()
        # `input` is an embedding (a causal LM's last hidden state, as /v1/embeddings).
        emb = http.post("/invocations", json={"input": "x"}, headers=auth).json()
        assert emb["object"] == "list" and len(emb["data"][0]["embedding"]) > 0
        # --disable-fastapi-docs was not given: the document is there, and names no
        # prefix (no --root-path).
        doc = http.get("/openapi.json").json()
        assert "/invocations" in doc["paths"] and "servers" not in doc


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "tls")
    with server_process(
        tmp_path, "service.cli", str(tiny_checkpoint("llama")),
        "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
        "--ssl-ca-certs", str(certs.ca), "--ssl-cert-reqs", "2", "--disable-fastapi-docs",
        tls=_client_tls(certs, with_cert=True),
    ) as (_, url):  # fmt: skip
        with (
            httpx.Client(verify=_client_tls(certs), timeout=30) as anonymous,
            pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)),
        ):
            anonymous.get(url + "/health")
        with httpx.Client(verify=_client_tls(certs, with_cert=True), timeout=30) as ok:
            assert ok.get(url + "/health").status_code == 200
            assert ok.get(url + "/openapi.json").status_code == 404


def test_a_unix_socket_serves_the_openai_client(tmp_path: Path) -> None:
    sock = str(tmp_path / "pagestream.sock")
    with server_process(tmp_path, "service.cli", str(tiny_checkpoint("llama")), uds=sock) as _:
        transport = httpx.HTTPTransport(uds=sock)
        client = openai.OpenAI(
            base_url="http://localhost/v1", api_key="none", max_retries=0,
            http_client=httpx.Client(transport=transport, timeout=60),
        )  # fmt: skip
        r = client.completions.create(model=client.models.list().data[0].id, prompt="one",
                                      max_tokens=2)  # fmt: skip
        assert r.usage.completion_tokens <= 2 and r.choices[0].finish_reason


def test_enable_log_requests_logs_each_prompt_cut_to_max_log_len(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.service.live_server import live_server

    model = str(tiny_checkpoint("llama"))
    body = {"prompt": "one two three four five", "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="pagestream.requests"):
        with live_server(model, enable_log_requests=True, max_log_len=5) as s:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        logged = [rec.getMessage() for rec in caplog.records if rec.name == "pagestream.requests"]
        assert len(logged) == 1 and r["id"].removeprefix("cmpl-") in logged[0], logged
        assert "prompt: 'one t'," in logged[0] and "temperature=0.0" in logged[0]
        ids = transformers.AutoTokenizer.from_pretrained(model)(body["prompt"]).input_ids
        assert f"prompt_token_ids: {ids[:5]}" in logged[0]
        caplog.clear()
        with live_server(model) as s:  # off by default: prompts are private
            httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert not [rec for rec in caplog.records if rec.name == "pagestream.requests"]


def test_gpu_memory_utilization_sizes_the_kv_cache_from_the_gpus_share() -> None:
    from gpu.model_runner import kv_budget

    gib = 1 << 30
    c = _config(["--gpu-memory-utilization", "0.9"])
    assert c.engine.cache.gpu_memory_utilization == 0.9
    # 80 GiB card, 16 GiB of weights loaded: 0.9 x 80 - 16 = 56 GiB for this engine past
    # its weights, 85% of that for KV (the rest for activations).
    assert kv_budget(64 * gib, 80 * gib, 16 * gib, 0.9) == int(56 * gib * 0.85)
    assert kv_budget(64 * gib, 80 * gib, 16 * gib, None) == int(64 * gib * 0.85)  # default
    # A second engine at 0.45 beside one that took its 36 GiB: its own share still fits.
    assert kv_budget(28 * gib, 80 * gib, 16 * gib, 0.45) == int(20 * gib * 0.85)
    # Never more than is free; nothing left (weights over the share): the runner refuses.
    assert kv_budget(8 * gib, 80 * gib, 16 * gib, 0.9) == int(8 * gib * 0.85)
    assert kv_budget(60 * gib, 80 * gib, 20 * gib, 0.2) == 0
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
            _config(["--gpu-memory-utilization", bad])
