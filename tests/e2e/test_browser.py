"""The chat page in a real headless chromium against a live server with a tiny model:
streaming into the bubble, multi-turn history, Stop (cancel frees the KV cache), the
system prompt, New chat, the API key, and a reasoning model's thinking."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.checkpoints import THINK_PROMPT, thinking_model, tiny_checkpoint
from tests.e2e.browser import (
    STREAM_RECORDER_JS,
    SocketLog,
    chromium_context,
    chromium_path,
    record_chats,
    settings,
    wait_connected,
    wait_until,
)
from tests.service.live_server import LiveServer, free_port, live_server

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

API_KEY = "browser-test-key"


@pytest.fixture(scope="module")
def model() -> str:
    chromium_path()  # skip before loading anything when there is no browser
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model: str) -> Iterator[LiveServer]:
    with live_server(model) as s:
        yield s


@pytest.fixture
def context(tmp_path) -> Iterator[Any]:
    with chromium_context(tmp_path / "profile") as ctx:
        yield ctx


def open_chat(context: Any, url: str) -> tuple[Any, SocketLog]:
    page = context.pages[0] if context.pages else context.new_page()
    page.add_init_script(STREAM_RECORDER_JS)
    sockets = SocketLog(page)  # before goto, so the first socket is seen
    page.goto(url + "/")
    return page, sockets


def test_streams_reply_and_keeps_history(server: LiveServer, context: Any) -> None:
    from playwright.sync_api import expect

    page, sockets = open_chat(context, server.url)
    wait_connected(page)
    expect(page.locator("#stop")).to_be_disabled()
    settings(page, max_tokens=48)
    system = page.input_value("#system-prompt")
    assert system  # a sensible default is there

    with record_chats(server.state.prep) as seen:
        page.fill("#input", "Hello there")
        page.press("#input", "Enter")
        first = page.locator(".msg.assistant").nth(0)
        expect(first).to_have_attribute("data-finish", "length")

        # Tokens streamed into the bubble: it showed at least two different non-empty
        # lengths before the reply finished.
        log = page.evaluate("window.__streamLog")
        growing = {e["len"] for e in log if e["bubble"] == 1 and not e["finish"] and e["len"]}
        assert len(growing) >= 2, log
        expect(first.locator(".stats")).to_contain_text("48 tokens")
        expect(first.locator(".stats")).to_contain_text("finish: length")
        expect(first.locator(".stats")).to_contain_text("tok/s")
        expect(page.locator("#stop")).to_be_disabled()
        first_reply = first.locator(".text").text_content()
        assert first_reply

        # Second turn, through the button this time.
        page.fill("#input", "And a follow-up")
        page.click("#send")
        expect(page.locator(".msg.assistant").nth(1)).to_have_attribute("data-finish", "length")

    expect(page.locator(".msg.user")).to_have_count(2)
    expect(page.locator(".msg.assistant")).to_have_count(2)
    expect(page.locator(".msg.user").nth(0)).to_have_text("Hello there")

    history = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "And a follow-up"},
    ]
    wait_until(page, lambda: len(sockets.sent_of("generate")) == 2, what="two generate frames")
    gens = sockets.sent_of("generate")
    assert gens[0]["messages"] == history[:2]
    assert gens[1]["messages"] == history
    assert gens[1]["params"]["max_tokens"] == 48
    assert gens[0]["id"] != gens[1]["id"]
    # ...and the server rendered the whole conversation into the second prompt.
    assert seen == [history[:2], history]
    server.wait_kv_free(timeout=5)


def test_stop_aborts_and_frees_kv(server: LiveServer, context: Any) -> None:
    from playwright.sync_api import expect

    page, sockets = open_chat(context, server.url)
    wait_connected(page)
    # Long enough that Stop lands mid-stream even on a fast machine (~3 ms a token).
    settings(page, max_tokens=1500)
    page.fill("#input", "Tell me a very long story")
    page.click("#send")
    expect(page.locator("#stop")).to_be_enabled()
    expect(page.locator("#send")).to_be_disabled()
    bubble = page.locator(".msg.assistant").nth(0)
    page.wait_for_function(
        "() => (document.querySelector('.msg.assistant .text')?.textContent.length ?? 0) > 0"
    )
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.click("#stop")
    except PlaywrightTimeout:  # say why Stop could not land, not just "timeout"
        frames = [f for f in sockets.received if f.get("type") != "delta"]
        tokens = sum(len(f.get("token_ids", ())) for f in sockets.received_of("delta"))
        finish = bubble.get_attribute("data-finish")
        pytest.fail(f"Stop stayed disabled: finish {finish!r}, {tokens} tokens, {frames[-3:]!r}")

    expect(bubble).to_have_attribute("data-finish", "abort")
    expect(bubble.locator(".stats")).to_contain_text("finish: abort")
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#send")).to_be_enabled()

    wait_until(page, lambda: sockets.sent_of("cancel"), what="the cancel frame")
    gen_id = sockets.sent_of("generate")[0]["id"]
    assert sockets.sent_of("cancel") == [{"type": "cancel", "id": gen_id}]
    wait_until(page, lambda: sockets.received_of("done", gen_id), what="the done frame")
    deltas = sockets.received_of("delta", gen_id)
    assert 0 < sum(len(d["token_ids"]) for d in deltas) < 1500
    # The engine dropped the request and every KV block went back to the pool.
    server.wait_kv_free(timeout=5)

    # The partial reply stays in the conversation and the page can go on.
    page.fill("#input", "Shorter, please")
    settings(page, max_tokens=4)
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant").nth(1)).to_have_attribute("data-finish", "length")
    second = sockets.sent_of("generate")[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == bubble.locator(".text").text_content()


def test_system_prompt_new_chat_and_text_only(server: LiveServer, context: Any) -> None:
    from playwright.sync_api import expect

    page, sockets = open_chat(context, server.url)
    wait_connected(page)
    settings(page, max_tokens=4)
    edited = "You are a terse pirate.\nAnswer in one word."
    page.fill("#system-prompt", edited)
    markup = "<img src=x onerror=\"document.body.dataset.pwned='1'\"><b>bold?</b>"

    with record_chats(server.state.prep) as seen:
        page.fill("#input", markup)
        page.press("#input", "Enter")
        expect(page.locator(".msg.assistant").nth(0)).to_have_attribute("data-finish", "length")

        # New chat clears the conversation; the next request carries no old turns.
        page.click("#new-chat")
        expect(page.locator(".msg")).to_have_count(0)
        page.fill("#input", "Ahoy")
        page.press("#input", "Enter")
        expect(page.locator(".msg.assistant").nth(0)).to_have_attribute("data-finish", "length")

    wait_until(page, lambda: len(sockets.sent_of("generate")) == 2, what="two generate frames")
    first, second = sockets.sent_of("generate")
    assert first["messages"][0] == {"role": "system", "content": edited}
    assert first["messages"][1] == {"role": "user", "content": markup}
    assert second["messages"] == [
        {"role": "system", "content": edited},
        {"role": "user", "content": "Ahoy"},
    ]
    assert seen[0][0] == {"role": "system", "content": edited}
    # User text is shown as text, never parsed as HTML.
    assert page.locator(".msg img, .msg b").count() == 0
    assert page.evaluate("document.body.dataset.pwned") is None

    # An empty system prompt sends no system turn at all.
    page.fill("#system-prompt", "  ")
    page.fill("#input", "No system")
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant").nth(1)).to_have_attribute("data-finish", "length")
    wait_until(page, lambda: len(sockets.sent_of("generate")) == 3, what="a third generate")
    third = sockets.sent_of("generate")[2]["messages"]
    assert third[0]["role"] == "user"
    assert third[-1] == {"role": "user", "content": "No system"}


def test_api_key_and_inline_errors(model: str, context: Any) -> None:
    from playwright.sync_api import expect

    with live_server(model, api_key=API_KEY) as server:
        page, sockets = open_chat(context, server.url)
        # Without the key the upgrade is refused (401) and the page keeps retrying.
        expect(page.locator("#status")).to_have_attribute("data-state", "closed")
        expect(page.locator("#status")).to_contain_text("API key")
        expect(page.locator("#send")).to_be_disabled()

        page.fill("#api-key", API_KEY)
        page.dispatch_event("#api-key", "change")
        wait_connected(page)
        assert page.evaluate("localStorage.getItem('pagestream.apiKey')") == API_KEY
        assert any(re.search(rf"[?&]api_key={API_KEY}(&|$)", u) for u in sockets.urls)

        # A parameter the server refuses comes back as an inline error on the reply, and
        # the failed turn is left out of the history.
        settings(page, max_tokens=4)
        page.fill("#temperature", "5")
        page.fill("#input", "Too hot")
        page.press("#input", "Enter")
        failed = page.locator(".msg.assistant").nth(0)
        expect(failed).to_have_attribute("data-finish", "error")
        expect(failed.locator(".error")).to_contain_text("temperature")
        expect(page.locator("#input")).to_have_value("Too hot")  # given back to resend

        page.fill("#temperature", "0")
        page.press("#input", "Enter")
        expect(page.locator(".msg.assistant").nth(1)).to_have_attribute("data-finish", "length")
        wait_until(page, lambda: len(sockets.sent_of("generate")) == 2, what="two generates")
        assert [m["role"] for m in sockets.sent_of("generate")[1]["messages"]] == [
            "system",
            "user",
        ]
        page.close()  # before the server goes, so its socket closes cleanly


def test_a_chat_longer_than_the_window_goes_on(model: str, context: Any) -> None:
    """The page asks for truncation "auto": past max_model_len the oldest turns are left
    out (the system prompt stays) and every reply still comes."""
    from playwright.sync_api import expect

    with live_server(model, engine_kwargs={"max_model_len": 160}) as server:
        page, sockets = open_chat(context, server.url)
        wait_connected(page)
        settings(page, max_tokens=12)
        with record_chats(server.state.prep) as seen:
            for i in range(7):
                page.fill("#input", f"Message {i}: " + "tell me more about the quiet river " * 2)
                page.press("#input", "Enter")
                reply = page.locator(".msg.assistant").nth(i)
                expect(reply).to_have_attribute("data-finish", "length")
        assert all(f.get("truncation") == "auto" for f in sockets.sent_of("generate"))
        sent = sockets.sent_of("generate")[-1]["messages"]
        assert len(sent) == 1 + 2 * 6 + 1  # the page sends the whole chat
        done = sockets.received_of("done", sockets.sent_of("generate")[-1]["id"])[0]
        assert done["usage"]["prompt_tokens"] + 12 <= 160
        # every prompt the server rendered kept the system prompt, and the first turns
        # were left out of the last ones
        assert all(m[0]["role"] == "system" for m in seen)
        assert not any("Message 0" in m[1]["content"] for m in seen[-3:])
        page.close()


def test_reconnects_after_server_restart(model: str, context: Any) -> None:
    from playwright.sync_api import expect

    port = free_port()
    # A short drain deadline: the running reply is cut off when the server goes away.
    with live_server(model, port=port, shutdown_timeout=0.5) as server:
        page, sockets = open_chat(context, server.url)
        wait_connected(page)
        settings(page, max_tokens=1500)
        page.fill("#input", "Keep talking")
        page.press("#input", "Enter")
        page.wait_for_function(
            "() => (document.querySelector('.msg.assistant .text')?.textContent.length ?? 0) > 0"
        )
    # The server is gone: the reply failed inline and the page is retrying.
    cut = page.locator(".msg.assistant").nth(0)
    expect(cut).to_have_attribute("data-finish", "error")
    expect(cut.locator(".error")).to_contain_text("connection lost")
    expect(page.locator("#status")).to_have_attribute("data-state", re.compile("closed|connecting"))
    expect(page.locator("#status")).to_contain_text("disconnected")
    expect(page.locator("#send")).to_be_disabled()

    with live_server(model, port=port) as server:
        # Backoff retries find the new server without a reload.
        wait_connected(page)
        assert len(sockets.urls) >= 2
        settings(page, max_tokens=4)
        page.press("#input", "Enter")  # the failed message was given back to the input
        expect(page.locator(".msg.assistant").nth(1)).to_have_attribute("data-finish", "length")
        page.close()


def test_a_reasoning_models_thinking_folds_above_its_answer(context: Any, tmp_path) -> None:
    """--reasoning-parser: the thinking streams into a fold, open until the answer
    starts; the next turn's history holds the answer alone."""
    from playwright.sync_api import expect

    model = thinking_model(tmp_path / "thinker")
    with live_server(model, reasoning_parser="qwen3") as s:
        page, sockets = open_chat(context, s.url)
        wait_connected(page)
        settings(page, max_tokens=24, seed=None)
        page.fill("#temperature", "0")
        page.fill("#system-prompt", "")  # the prompt the checkpoint closes its thinking on
        page.fill("#input", THINK_PROMPT[0]["content"])
        page.press("#input", "Enter")
        reply = page.locator(".msg.assistant").nth(0)
        expect(reply).to_have_attribute("data-finish", "length")

        (gen,) = sockets.sent_of("generate")
        deltas = sockets.received_of("delta", gen["id"])
        thinking = "".join(f.get("reasoning", "") for f in deltas)
        answer = "".join(f["text"] for f in deltas)
        assert thinking and answer
        fold = reply.locator("details.thinking")
        expect(fold.locator("div")).to_have_text(thinking)
        assert not fold.evaluate("d => d.open")  # folded once the answer began
        assert reply.locator(".text").text_content() == answer

        page.fill("#input", "And then?")
        page.press("#input", "Enter")
        wait_until(page, lambda: len(sockets.sent_of("generate")) == 2, what="second turn")
        assert sockets.sent_of("generate")[1]["messages"][1] == {
            "role": "assistant",
            "content": answer,
        }
