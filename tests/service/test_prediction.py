"""OpenAI's predicted outputs (`prediction` on a chat completion), through the official
client: the answer is the one without a prediction (the model verifies every drafted
token), a server speculating with n-gram drafts or a draft model takes them from the
prediction first, and
usage counts the drafts kept and refused (`accepted_prediction_tokens`,
`rejected_prediction_tokens`)."""

from __future__ import annotations

import openai
import pytest

from service.engine_setup import default_draft_dir, default_model_dir
from tests.service.live_server import live_server

# The shipped model writes code: it continues an assistant message that opened a class.
MESSAGES = [
    {"role": "user", "content": "Write some Python."},
    {"role": "assistant", "content": "class Stack:\n    def push(self, item):"},
]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
MAX_TOKENS = 48
# A top-2 logit gap below this is a near-tie, where verifying several positions at once
# may round the other way (tests/service/test_spec_serving.py).
TIE_MARGIN = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, prediction: str | None = None, **kw):
    if prediction is not None:  # the SDK's own parameter
        kw["prediction"] = {"type": "content", "content": prediction}
    return client.chat.completions.create(
        model="pair", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=CONTINUE, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain():
    """The answer without speculation, cut before its first near-tie; and that server."""
    kw = {"threads": 1, "num_kv_blocks": 128}
    with live_server(str(default_model_dir()), served_model_name="pair", engine_kwargs=kw) as s:
        r = _ask(_client(s), logprobs=True, top_logprobs=2)
        lps = r.choices[0].logprobs.content
        gaps = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in lps]
        decided = next((i for i, g in enumerate(gaps) if g < TIE_MARGIN), len(gaps))
        assert decided >= 24, f"near-tie at token {decided}: pick another prompt"
        text = "".join(t.token for t in lps[:decided])
        assert r.choices[0].message.content.startswith(text)
        yield s, r.choices[0].message.content, text


@pytest.fixture(scope="module", params=["ngram", "draft"])
def speculating(request):
    spec = {"method": request.param, "num_speculative_tokens": 4, "min_acceptance_rate": 0.0}
    if request.param == "draft":  # the prediction's drafts first, the draft model's after
        spec["model"] = str(default_draft_dir())
    kw = {"threads": 1, "num_kv_blocks": 128, "speculative_config": spec}
    with live_server(str(default_model_dir()), served_model_name="pair", engine_kwargs=kw) as s:
        # Every decode step speculates: the cost policy picks by this machine's timing.
        s.engine.scheduler.spec.policy.choose = lambda *a, **k: True
        yield s


def test_a_server_without_speculation_takes_the_prediction_and_answers_the_same(plain):
    s, full, _ = plain
    r = _ask(_client(s), prediction=full)
    assert r.choices[0].message.content == full
    details = r.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    s.wait_kv_free()


def test_a_perfect_prediction_is_drafted_and_kept(plain, speculating):
    _, full, decided = plain
    client = _client(speculating)
    r = _ask(client, prediction=full)
    assert r.choices[0].message.content.startswith(decided)
    details = r.usage.completion_tokens_details
    # Each step drafts 4 and keeps them: most of the answer came from the prediction.
    assert details.accepted_prediction_tokens >= MAX_TOKENS // 2, details
    assert details.rejected_prediction_tokens <= 8, details
    speculating.wait_kv_free()


def test_an_edited_prediction_finds_its_place_again(plain, speculating):
    _, full, decided = plain
    words = full.split(" ")
    cut = len(words) // 3
    # A passage the model will not write, in the middle: drafts there are refused, and
    # the ones after it are kept again.
    edited = " ".join([*words[:cut], "purple", "elephants", "sing", *words[cut:]])
    client = _client(speculating)
    r = _ask(client, prediction=edited)
    assert r.choices[0].message.content.startswith(decided)
    details = r.usage.completion_tokens_details
    assert details.rejected_prediction_tokens > 0, details
    assert details.accepted_prediction_tokens >= MAX_TOKENS // 3, details
    # Streamed: the same text, the counts in the usage chunk.
    stream = _ask(client, prediction=edited, stream=True,
                  stream_options={"include_usage": True})  # fmt: skip
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == r.choices[0].message.content
    assert usage is not None and usage.completion_tokens_details.accepted_prediction_tokens > 0
    speculating.wait_kv_free()


@pytest.mark.parametrize(
    "prediction",
    [{"type": "image", "content": "x"}, {"type": "content"}, {"content": "x"},
     {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}],
)  # fmt: skip
def test_a_malformed_prediction_is_a_400_naming_it(plain, prediction):
    s, _, _ = plain
    with pytest.raises(openai.BadRequestError) as e:
        _client(s).chat.completions.create(
            model="pair", messages=MESSAGES, max_tokens=2, extra_body={"prediction": prediction}
        )
    assert e.value.body["param"].startswith("prediction"), e.value.body
    s.wait_kv_free()
