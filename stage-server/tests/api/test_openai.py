"""The OpenAI API of `stage-server run`, exercised with the official `openai` client (and raw HTTP where it must be).

Generations are kept to a few tokens: SmolLM2-135M decodes about 50 tokens/s here, and the point is the API's
shapes and rules, not the text. Greedy requests (temperature 0) are deterministic, so a second request can be
checked against the first.
"""

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import API_KEY, AUTH_MODEL_ID, LANES, QUEUE

CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
# A prompt whose continuation does not end within a few tokens, so max_tokens is what ends it.
COUNTING = "Count from one to fifty in words: one, two, three, four,"
# The server must refuse a body larger than this with 413.
BODY_LIMIT_BYTES = 4 * 1024 * 1024


def chat(client, server, **arguments):
    arguments.setdefault("model", server.model_id)
    arguments.setdefault("messages", CHAT)
    arguments.setdefault("max_tokens", 8)
    arguments.setdefault("temperature", 0)
    return client.chat.completions.create(**arguments)


def complete(client, server, **arguments):
    arguments.setdefault("model", server.model_id)
    arguments.setdefault("prompt", COUNTING)
    arguments.setdefault("max_tokens", 8)
    arguments.setdefault("temperature", 0)
    return client.completions.create(**arguments)


def collect_chat_stream(stream):
    """The text, finish reason and usage of a streamed chat completion."""
    text, finish_reason, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
    return "".join(text), finish_reason, usage


def collect_completion_stream(stream):
    text, finish_reason, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.text or "")
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
    return "".join(text), finish_reason, usage


def error_param(error: openai.APIStatusError):
    """The `param` of an OpenAI error envelope (the client puts the envelope's inside in `body`)."""
    body = error.body if isinstance(error.body, dict) else {}
    return body.get("param")


def assert_envelope(response: httpx2.Response, status: int):
    assert response.status_code == status, (
        f"expected {status}, got {response.status_code}: {response.text[:300]}"
    )
    try:
        envelope = response.json()
    except json.JSONDecodeError:
        pytest.fail(f"a {status} should carry a JSON error envelope, got: {response.text[:300]}")
    error = envelope.get("error") if isinstance(envelope, dict) else None
    assert isinstance(error, dict), f"no `error` object in the envelope: {envelope}"
    assert isinstance(error.get("message"), str) and error["message"], f"the envelope has no message: {envelope}"
    assert "type" in error, f"the envelope has no type: {envelope}"
    return error


def wait_until_idle(server, client, timeout=30.0):
    """Waits until a one-token request is served, i.e. the lanes and queue have room again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            chat(client, server, max_tokens=1)
            return
        except openai.RateLimitError:
            if time.monotonic() > deadline:
                pytest.fail(f"the server still refused requests with 429 {timeout} s after the load ended")
            time.sleep(0.2)


# ---------------------------------------------------------------- health, models, tokenizer, metrics


def test_health_says_ok_once_ready(server):
    response = httpx2.get(f"{server.base_url}/health", timeout=10.0)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok"}


def test_models_lists_the_served_model(server, client):
    models = client.models.list()
    ids = [model.id for model in models.data]
    assert ids == [server.model_id], f"one model, the one served: {ids}"
    assert models.data[0].object == "model"
    reply = chat(client, server, max_tokens=1)
    assert reply.model == server.model_id, "a completion names the model it came from"


def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello, world! Pipelines split models into stages."
    response = httpx2.post(f"{server.base_url}/tokenize", json={"content": text}, timeout=10.0)
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    assert tokens and all(isinstance(token, int) for token in tokens), f"token ids: {tokens}"
    back = httpx2.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=10.0)
    assert back.status_code == 200, back.text
    assert back.json()["content"] == text, "detokenizing the tokens gives the text back"


def test_metrics_are_served_as_text(server):
    response = httpx2.get(f"{server.base_url}/metrics", timeout=10.0)
    assert response.status_code == 200, response.text
    assert response.headers.get("content-type", "").startswith("text/plain"), response.headers
    assert response.text.strip(), "the metrics page is not empty"


def test_metrics_parse_as_prometheus_text_with_the_request_counter_and_the_histograms(server, client):
    # A completion first, so the counter has a sample for its route and the latency histograms have data.
    chat(client, server, max_tokens=3)
    response = httpx2.get(f"{server.base_url}/metrics", timeout=10.0)
    assert response.status_code == 200, response.text
    try:
        families = {family.name: family for family in text_string_to_metric_families(response.text)}
    except ValueError as error:
        pytest.fail(f"/metrics is not Prometheus text ({error}):\n{response.text}")
    # The parser names a counter's family without its `_total` suffix (its samples keep it).
    requests = families.get("stage_server_requests") or families.get("stage_server_requests_total")
    assert requests is not None and requests.type == "counter", sorted(families)
    chat_samples = [
        sample
        for sample in requests.samples
        if sample.name == "stage_server_requests_total"
        and sample.labels.get("route") == "/v1/chat/completions"
        and sample.labels.get("status") == "200"
    ]
    assert chat_samples and chat_samples[0].value >= 1, f"no count of the chat request: {requests.samples}"
    for name in (
        "stage_server_time_to_first_token_seconds",
        "stage_server_inter_token_seconds",
        "stage_server_queue_wait_seconds",
    ):
        family = families.get(name)
        assert family is not None and family.type == "histogram", f"{name} missing: {sorted(families)}"
        suffixes = {sample.name[len(name):] for sample in family.samples}
        assert {"_bucket", "_sum", "_count"} <= suffixes, f"{name} samples: {family.samples}"
        infinite = [sample for sample in family.samples if sample.labels.get("le") == "+Inf"]
        count = [sample for sample in family.samples if sample.name == f"{name}_count"]
        assert infinite and count and infinite[0].value == count[0].value >= 1, family.samples


def test_every_response_echoes_x_request_id(server):
    sent = {"x-request-id": "conformance-echo-1", **server.headers()}
    for method, path, body in (
        ("GET", "/health", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
        ("GET", "/no/such/route", None),
        ("POST", "/v1/completions", {"model": server.model_id, "prompt": "Hi", "max_tokens": 2}),
        ("POST", "/v1/completions", {"model": server.model_id, "prompt": "Hi", "max_tokens": "two"}),
    ):
        response = httpx2.request(method, f"{server.base_url}{path}", json=body, headers=sent, timeout=30.0)
        assert response.headers.get("x-request-id") == "conformance-echo-1", (
            f"{method} {path} answered {response.status_code} without the request's id: {response.headers}"
        )
    streamed = {"model": server.model_id, "prompt": "Hi", "max_tokens": 2, "stream": True}
    url = f"{server.base_url}/v1/completions"
    with httpx2.stream("POST", url, json=streamed, headers=sent, timeout=30.0) as response:
        assert response.headers.get("x-request-id") == "conformance-echo-1", response.headers
        response.read()
    # Without one the server makes one up, different each time.
    first = httpx2.get(f"{server.base_url}/health", timeout=10.0).headers.get("x-request-id")
    second = httpx2.get(f"{server.base_url}/health", timeout=10.0).headers.get("x-request-id")
    assert first and second and first != second, (first, second)


# ---------------------------------------------------------------- chat and completions


def test_chat_completion_reports_usage_that_matches_its_tokens(server, client):
    reply = chat(client, server, max_tokens=12, logprobs=True)
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content, "the reply has text"
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0, "the chat prompt has tokens"
    generated = len(choice.logprobs.content)
    assert usage.completion_tokens == generated, (
        f"completion_tokens {usage.completion_tokens} should count the {generated} tokens generated"
    )
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_reports_usage(server, client):
    reply = complete(client, server)
    choice = reply.choices[0]
    assert reply.object == "text_completion"
    assert choice.text, "the completion has text"
    prompt_tokens = httpx2.post(f"{server.base_url}/tokenize", json={"content": COUNTING}, timeout=10.0).json()
    assert reply.usage.prompt_tokens >= len(prompt_tokens["tokens"]) > 0, (
        f"prompt_tokens {reply.usage.prompt_tokens} should count the prompt's {len(prompt_tokens['tokens'])} tokens"
    )
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_ends_a_chat_reply_with_length_after_exactly_that_many(server, client, max_tokens):
    reply = chat(client, server, max_tokens=max_tokens, logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "length", f"finish_reason {choice.finish_reason!r} for max_tokens={max_tokens}"
    assert reply.usage.completion_tokens == max_tokens
    assert len(choice.logprobs.content) == max_tokens, "one logprobs entry per generated token"


def test_max_tokens_ends_a_completion_with_length(server, client):
    reply = complete(client, server, max_tokens=6)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6


def test_a_streamed_chat_reply_equals_the_whole_one(server, client):
    whole = chat(client, server, max_tokens=16)
    stream = chat(client, server, max_tokens=16, stream=True, stream_options={"include_usage": True})
    text, finish_reason, usage = collect_chat_stream(stream)
    assert text == whole.choices[0].message.content, "greedy decoding streams the same text it returns whole"
    assert finish_reason == whole.choices[0].finish_reason
    assert usage is not None, "include_usage sends a usage chunk"
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_streamed_completion_equals_the_whole_one(server, client):
    whole = complete(client, server, max_tokens=10)
    stream = complete(client, server, max_tokens=10, stream=True, stream_options={"include_usage": True})
    text, finish_reason, usage = collect_completion_stream(stream)
    assert text == whole.choices[0].text
    assert finish_reason == whole.choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == 10


def test_a_raw_stream_is_server_sent_events_ending_in_done(server):
    body = {
        "model": server.model_id,
        "messages": CHAT,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with httpx2.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60.0) as response:
        assert response.status_code == 200
        assert response.headers.get("content-type", "").startswith("text/event-stream"), response.headers
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events, "the stream has data events"
    assert events[-1].strip() == "data: [DONE]", f"the last event is [DONE]: {events[-3:]}"
    for event in events[:-1]:
        chunk = json.loads(event[len("data:"):])
        assert chunk["object"] == "chat.completion.chunk", chunk


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_the_reply_before_it(server, client, streaming):
    # The greedy reply without a stop tells which text the stop string will cut at.
    full = complete(client, server, max_tokens=16).choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", full)
    candidates = [word for word in words if full.index(word) > 0]
    assert candidates, f"the greedy completion should have a word past its start to stop at: {full!r}"
    stop = candidates[len(candidates) // 2]
    expected = full[: full.index(stop)]
    if streaming:
        text, finish_reason, _ = collect_completion_stream(
            complete(client, server, max_tokens=16, stop=[stop], stream=True)
        )
    else:
        reply = complete(client, server, max_tokens=16, stop=[stop])
        text, finish_reason = reply.choices[0].text, reply.choices[0].finish_reason
    assert stop not in text, f"the stop string {stop!r} must not appear: {text!r}"
    assert finish_reason == "stop", f"a matched stop string ends with stop, not {finish_reason!r}"
    assert text == expected, f"the text up to the stop string {stop!r}: {text!r} vs {expected!r}"


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_a_chat_reply(server, client, streaming):
    full = chat(client, server, max_tokens=16).choices[0].message.content
    words = [word for word in re.findall(r"[A-Za-z]{3,}", full) if full.index(word) > 0]
    assert words, f"the greedy reply should have a word past its start to stop at: {full!r}"
    stop = words[0]
    if streaming:
        text, finish_reason, _ = collect_chat_stream(chat(client, server, max_tokens=16, stop=stop, stream=True))
    else:
        reply = chat(client, server, max_tokens=16, stop=stop)
        text, finish_reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert stop not in text, f"the stop string {stop!r} must not appear: {text!r}"
    assert finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_the_same_seed_repeats_and_different_seeds_differ(server, client):
    def sample(seed):
        return complete(client, server, prompt="My favourite animal is", max_tokens=8, temperature=1.0, seed=seed)

    texts = {seed: sample(seed).choices[0].text for seed in (11, 12, 13, 14)}
    assert sample(11).choices[0].text == texts[11], "a seed at temperature 1 gives the same text again"
    assert len(set(texts.values())) >= 2, f"four seeds at temperature 1 should not all agree: {texts}"


def test_chat_logprobs_list_the_tokens_and_sorted_alternatives(server, client):
    reply = chat(client, server, max_tokens=8, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert entries, "logprobs=True gives an entry per token"
    assert "".join(entry.token for entry in entries) == choice.message.content, (
        "the entries' tokens concatenate to the content"
    )
    for entry in entries:
        assert entry.logprob <= 0.0
        alternatives = entry.top_logprobs
        assert len(alternatives) == 3, f"top_logprobs=3 gives three alternatives: {alternatives}"
        values = [alternative.logprob for alternative in alternatives]
        assert values == sorted(values, reverse=True), f"alternatives are sorted, most likely first: {values}"
        # Greedy decoding picks the most likely token, so it heads its own list.
        assert alternatives[0].token == entry.token, f"{entry.token!r} should be the top alternative"
        assert abs(alternatives[0].logprob - entry.logprob) < 1e-4


# ---------------------------------------------------------------- errors


def test_an_unknown_model_is_404_model_not_found(server, client):
    with pytest.raises(openai.NotFoundError) as raised:
        chat(client, server, model="no-such-model")
    assert raised.value.status_code == 404
    assert raised.value.code == "model_not_found", f"the envelope's code: {raised.value.body}"


@pytest.mark.parametrize(
    "field, value",
    [("temperature", "hot"), ("max_tokens", "many"), ("messages", "not a list"), ("stream", "yes")],
)
def test_a_field_of_the_wrong_type_is_400_naming_it(server, client, field, value):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, server, **{field: value})
    assert raised.value.status_code == 400
    assert error_param(raised.value) == field, f"the envelope names {field}: {raised.value.body}"


def test_more_than_one_choice_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, server, n=2)
    assert error_param(raised.value) == "n", f"the envelope names n: {raised.value.body}"


@pytest.mark.parametrize(
    "call, arguments, param",
    [
        ("complete", {"echo": True}, "echo"),
        ("complete", {"suffix": "}"}, "suffix"),
        ("complete", {"best_of": 2}, "best_of"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format.type"),
    ],
    ids=["echo", "suffix", "best_of", "tools", "json_mode"],
)
def test_a_parameter_that_would_change_the_answer_and_is_not_supported_is_400_naming_it(
    server, client, call, arguments, param
):
    with pytest.raises(openai.BadRequestError) as raised:
        (complete if call == "complete" else chat)(client, server, **arguments)
    assert error_param(raised.value) == param, f"the envelope names {param}: {raised.value.body}"
    assert "not supported" in str(raised.value.body), raised.value.body


def test_a_logit_bias_outside_the_vocabulary_is_400_naming_the_id(server, client):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, server, logit_bias={"99999999": 5}, max_tokens=1)
    assert error_param(raised.value) == "logit_bias.99999999", raised.value.body


def test_a_prompt_longer_than_the_context_is_400_with_both_numbers(server, client):
    prompt = " hello" * 24_000
    counted = httpx2.post(f"{server.base_url}/tokenize", json={"content": prompt}, timeout=60.0)
    assert counted.status_code == 200, counted.text
    prompt_tokens = len(counted.json()["tokens"])
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as raised:
        complete(client, server, prompt=prompt, max_tokens=4, timeout=60.0)
    assert time.monotonic() - started < 30, "a too-long prompt is refused before any compute"
    message = raised.value.body.get("message", "") if isinstance(raised.value.body, dict) else str(raised.value)
    numbers = [int(number) for number in re.findall(r"\d+", message.replace(",", ""))]
    assert any(prompt_tokens <= number <= prompt_tokens + 2 for number in numbers), (
        f"the message names the prompt's {prompt_tokens} tokens: {message!r}"
    )
    assert any(0 < number < prompt_tokens for number in numbers), f"the message names the context length: {message!r}"


def test_broken_json_is_400(server):
    response = httpx2.post(
        f"{server.base_url}/v1/chat/completions",
        content=b'{"messages": [',
        headers={"Content-Type": "application/json"},
        timeout=10.0,
    )
    assert_envelope(response, 400)


def test_a_body_over_4_mib_is_413(server):
    body = b'{"prompt": "' + b"x" * (BODY_LIMIT_BYTES + 1024) + b'"}'
    try:
        response = httpx2.post(
            f"{server.base_url}/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=30.0,
        )
    except httpx2.TransportError as error:
        pytest.fail(
            f"the server broke the connection ({type(error).__name__}: {error}) instead of answering 413 "
            "to a body over 4 MiB; it should send 413 and then read or linger before closing"
        )
    assert_envelope(response, 413)


def test_a_body_over_4_mib_is_refused_on_its_content_length(server):
    # Only the head is sent: a server that judges the announced length answers without waiting for 4 MiB.
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10.0) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(BODY_LIMIT_BYTES + 1).encode() + b"\r\n\r\n"
        )
        try:
            head = connection.recv(4096)
        except TimeoutError:
            pytest.fail("the server waited for a body its Content-Length already put over 4 MiB instead of answering 413")
    assert head.startswith(b"HTTP/1.1 413"), f"the answer to a 4 MiB + 1 Content-Length: {head[:200]!r}"


def test_an_unknown_route_is_404(server):
    response = httpx2.get(f"{server.base_url}/v1/no-such-route", timeout=10.0)
    assert_envelope(response, 404)


# ---------------------------------------------------------------- authentication


def test_without_the_key_a_server_with_api_key_answers_401(auth_server):
    with auth_server.client(api_key="not-the-key") as wrong:
        with pytest.raises(openai.AuthenticationError):
            chat(wrong, auth_server, max_tokens=1)
    response = httpx2.post(
        f"{auth_server.base_url}/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 1},
        timeout=10.0,
    )
    assert_envelope(response, 401)


def test_the_401_names_its_scheme_and_the_scheme_is_case_insensitive(auth_server):
    url = f"{auth_server.base_url}/v1/chat/completions"
    body = {"messages": CHAT, "max_tokens": 1}
    refused = httpx2.post(url, json=body, timeout=10.0)
    assert refused.status_code == 401
    assert refused.headers.get("www-authenticate") == "Bearer", refused.headers
    for scheme in ["bearer", "BEARER"]:
        served = httpx2.post(url, json=body, headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=60.0)
        assert served.status_code == 200, f"{scheme}: {served.status_code} {served.text}"


def test_with_the_key_a_server_with_api_key_serves(auth_server):
    with auth_server.client(api_key=API_KEY) as right:
        models = right.models.list()
        assert [model.id for model in models.data] == [AUTH_MODEL_ID], "--model-id names the served model"
        reply = chat(right, auth_server, max_tokens=2)
        assert reply.choices[0].message.content is not None
        assert reply.model == AUTH_MODEL_ID


# ---------------------------------------------------------------- load


def test_more_requests_than_lanes_and_queue_are_refused_with_429_and_retry_after(server, client):
    wait_until_idle(server, client)
    capacity = LANES + QUEUE
    attempts = capacity + 4
    start = threading.Barrier(attempts)
    release = threading.Event()
    lock = threading.Lock()
    accepted, refused, failed = [], [], []

    def attempt():
        start.wait()
        try:
            stream = chat(client, server, max_tokens=200, stream=True)
        except openai.RateLimitError as error:
            with lock:
                refused.append(error)
            return
        except Exception as error:  # noqa: BLE001 - every other outcome is reported, not raised in a thread
            with lock:
                failed.append(error)
            return
        with lock:
            accepted.append(stream)
        # Hold the lane (or the queue place) until every attempt has been answered, then hang up.
        release.wait(timeout=60)
        stream.close()

    threads = [threading.Thread(target=attempt) for _ in range(attempts)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with lock:
            answered = len(accepted) + len(refused) + len(failed)
        # Queued requests may get their response head only when a lane frees, so do not wait for them.
        if answered >= attempts or (refused and answered >= attempts - QUEUE):
            break
        time.sleep(0.05)
    release.set()
    for thread in threads:
        thread.join(timeout=90)
    assert not failed, f"requests failed with something other than 429: {failed!r}"
    assert refused, f"{attempts} simultaneous streams against {LANES} lanes and a queue of {QUEUE}: none got 429"
    assert len(refused) >= attempts - capacity, (
        f"{attempts} simultaneous streams, room for {capacity}: {len(refused)} refused"
    )
    for error in refused:
        retry_after = error.response.headers.get("retry-after")
        assert retry_after is not None and retry_after.strip().isdigit() and int(retry_after) >= 1, (
            f"a 429 carries Retry-After in whole seconds: {retry_after!r}"
        )
    wait_until_idle(server, client)


def busy_lanes(server):
    """The lanes-busy gauge from /metrics, when the server exports one under a recognisable name."""
    text = httpx2.get(f"{server.base_url}/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if re.search(r"lanes?_busy|busy_lanes|lanes?_in_use|active_lanes", name):
            return float(value)
    return None


def test_a_dropped_stream_frees_its_lane(server, client):
    wait_until_idle(server, client)
    # Fill every lane with a long reply and hang up on each after its first chunk.
    for _ in range(LANES):
        stream = chat(client, server, max_tokens=1000, stream=True)
        first = next(iter(stream))
        assert first.object == "chat.completion.chunk"
        stream.close()
    started = time.monotonic()
    if busy_lanes(server) is not None:
        while busy_lanes(server) != 0:
            assert time.monotonic() - started < 10, "the lanes-busy gauge should fall back to 0 after the hang-ups"
            time.sleep(0.1)
    # Had the dropped replies kept their lanes, these would overflow the queue and get 429.
    with ThreadPoolExecutor(max_workers=LANES + QUEUE) as pool:
        futures = [pool.submit(chat, client, server, max_tokens=4) for _ in range(LANES + QUEUE)]
        replies = [future.result(timeout=60) for future in futures]
    elapsed = time.monotonic() - started
    assert all(reply.choices[0].finish_reason in ("stop", "length") for reply in replies)
    assert elapsed < 30, f"{LANES + QUEUE} four-token replies after the hang-ups took {elapsed:.1f} s"


# ---------------------------------------------------------------- batching and prefix reuse


def test_concurrent_replies_equal_the_same_requests_one_at_a_time(server, client):
    wait_until_idle(server, client)
    conversations = [
        [{"role": "user", "content": "Name three rivers of Europe."}],
        [{"role": "user", "content": "Write one sentence about the sea, then one about the mountains."}],
    ]

    def reply(messages):
        answer = chat(client, server, messages=messages, max_tokens=24, logprobs=True)
        return answer.choices[0].message.content, [entry.logprob for entry in answer.choices[0].logprobs.content]

    alone = [reply(messages) for messages in conversations]
    shared_before = shared_passes(server)
    with ThreadPoolExecutor(max_workers=LANES) as pool:
        together = list(pool.map(reply, conversations))
    for index, (batched, single) in enumerate(zip(together, alone)):
        assert batched == single, f"conversation {index} answered differently when it ran beside another"
    # Some of their steps ran as one forward pass: the whole model gathers its lanes' next tokens, and a chain's
    # stage 0 holds a lane whose token came back until the other lane's is back too (--batches-in-flight 1).
    assert shared_passes(server) > shared_before, "no forward pass of stage 0 served both conversations at once"


def shared_passes(server):
    """Stage 0's forward passes that served more than one lane, from its batch-size histogram."""
    text = httpx2.get(f"{server.base_url}/metrics", timeout=10.0).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    family = families.get("stage_server_batch_entries")
    assert family is not None, "/metrics has no stage_server_batch_entries histogram"
    values = {(sample.name, sample.labels.get("le")): sample.value for sample in family.samples}
    return values[("stage_server_batch_entries_count", None)] - values[("stage_server_batch_entries_bucket", "1")]


def test_a_conversation_prefix_already_computed_is_reported_as_cached_tokens(server, client):
    wait_until_idle(server, client)
    system = {
        "role": "system",
        "content": "You are a patient tutor. " + " ".join(f"Rule {number}: answer in plain words." for number in range(20)),
    }
    first = chat(client, server, messages=[system, {"role": "user", "content": "What is a prime number?"}], max_tokens=4)
    second = chat(client, server, messages=[system, {"role": "user", "content": "What is an even number?"}], max_tokens=4)
    details = second.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    # The lane that holds the system prompt is reused: every token up to the user's turn. (On a chain, the
    # lane whose session kept it at every stage takes the request.)
    assert cached is not None and cached > first.usage.prompt_tokens // 2, (
        f"the shared system prompt was not reused: cached_tokens {cached} of {second.usage.prompt_tokens}"
    )
    assert cached < second.usage.prompt_tokens
