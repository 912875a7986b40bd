"""`kvtier engine`'s OpenAI API through the official `openai` client package.

Completions and chat (plain and streamed), stop sequences, logprobs, usage with cached
tokens, and the errors, each as the client raises it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

import openai
import pytest

from conftest import Engine, start_engine, stop

MODEL = "tiny-moe"
FLAGS = (
    "--model", MODEL, "--block-tokens", "16", "--device-slots", "64", "--kv-reuse", "device",
)
PROMPT = "The quick brown fox jumps over the lazy dog; " * 3  # 135 bytes: 8 full blocks
MESSAGES: list[dict[str, str]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three prime numbers."},
]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = start_engine(*FLAGS)
    yield e
    stop(e.process)


@pytest.fixture(scope="module")
def client(engine: Engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0)


def test_models_are_listed_and_retrieved(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert "gpt-4" in e.value.message


def test_completions_report_cached_tokens_and_repeat_greedy(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert first.object == "text_completion"
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(PROMPT), 8)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert again.choices[0].text == first.choices[0].text, "a device hit gives the same text"
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    # Every full block of the prompt but the last token's is served from the device cache.
    assert again.usage.prompt_tokens_details.cached_tokens == (len(PROMPT) - 1) // 16 * 16


def test_streamed_completion_matches_the_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and not chunks[-1].choices


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY)
    text = full.choices[0].text
    # A two-character stop from the middle of the greedy output (it spans tokens).
    at = next(
        i
        for i in range(2, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
    )
    stop_at = text[at : at + 2]
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop_at, "never-appears"], **GREEDY
    )
    assert r.choices[0].text == text[:at]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop_at, stream=True, **GREEDY
    )
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == text[:at]
    assert chunks[-1].finish_reason == "stop"


def test_completion_logprobs_come_from_the_distribution(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Keyed by text: tokens that decode alike share an entry, so at most 3.
        assert 1 <= len(top) <= 3 and chosen <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-4
    # Offsets into the returned text (as vLLM gives them without echo).
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_plain_and_streamed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, logprobs=True, top_logprobs=2, **GREEDY
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 10
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 10
    for t in choice.logprobs.content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0.0
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-5)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    # The rendered conversation was cached by the first call.
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (lambda c: c.completions.create(model="gpt-4", prompt="hi"), openai.NotFoundError, "gpt-4"),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", temperature=5),
            openai.BadRequestError,
            "temperature",
        ),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", best_of=3),
            openai.BadRequestError,
            "best_of",
        ),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", suffix="x"),
            openai.BadRequestError,
            "suffix",
        ),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", presence_penalty=1.5),
            openai.BadRequestError,
            "presence_penalty",
        ),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", echo=True, logprobs=1),
            openai.BadRequestError,
            "echo",
        ),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", logprobs=21),
            openai.BadRequestError,
            "logprobs",
        ),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=0),
            openai.BadRequestError,
            "max_tokens",
        ),
        (
            lambda c: c.completions.create(model=MODEL, prompt="hi", extra_body={"frobnicate": 1}),
            openai.BadRequestError,
            "frobnicate",
        ),
        (
            lambda c: c.chat.completions.create(model=MODEL, messages=[]),
            openai.BadRequestError,
            "messages",
        ),
        (
            lambda c: c.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]
            ),
            openai.BadRequestError,
            "tools",
        ),
        (
            lambda c: c.chat.completions.create(model="gpt-4", messages=MESSAGES),
            openai.NotFoundError,
            "gpt-4",
        ),
    ],
)
def test_errors_are_raised_with_the_servers_message(
    client: openai.OpenAI,
    call: Callable[[openai.OpenAI], object],
    error: type[openai.APIStatusError],
    needle: str,
) -> None:
    with pytest.raises(error) as e:
        call(client)
    assert needle in e.value.message, e.value.message
    body = e.value.body
    assert isinstance(body, dict) and needle in body["message"], body


def test_past_the_waiting_queue_requests_get_503_with_retry_after(
    engine_factory: Callable[..., Engine],
) -> None:
    e = engine_factory(*FLAGS, "--max-running", "1", "--max-waiting", "1")
    c = openai.OpenAI(base_url=e.base_url, api_key="unused", max_retries=0, timeout=120)
    served: list[int] = []
    refused: list[openai.APIStatusError] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            r = c.completions.create(
                model=MODEL, prompt=f"{i} {PROMPT}", max_tokens=48, **GREEDY
            )
            with lock:
                served.append(r.usage.completion_tokens if r.usage else 0)
        except openai.APIStatusError as err:
            with lock:
                refused.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(served) + len(refused) == 8
    assert served and all(n == 48 for n in served)
    assert refused, "8 at once with room for 2 must refuse some"
    for err in refused:
        assert err.status_code == 503, err
        assert err.response.headers.get("retry-after") == "1"
    # The client's own retry (it honours Retry-After) gets through once there is room.
    patient = openai.OpenAI(base_url=e.base_url, api_key="unused", max_retries=5)
    r = patient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **GREEDY)
    assert r.choices[0].text is not None
