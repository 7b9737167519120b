"""The OpenAI-compatible frontend in front of a real tritonserver (SmolLM2), through the official
`openai` client, sync and async: answers, streams, n, usage, stop strings, errors, hang-ups.

One frontend process for the session (conftest.py's ``frontend``), in front of the session's
tritonserver. The BLS-entry frontend and the one with no Triton behind it run in this process, made
from their command lines' flags (``in_process_frontend``): the app and the flags are the ones a
`python -m openai_frontend` process serves, without an interpreter and its imports per frontend (the
session frontend and the several-workers test start real processes).
"""
import asyncio
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from test_metrics import kv_and_requests, scrape
from triton_helpers import free_port, in_process_frontends, running_frontend, wait_for

pytestmark = pytest.mark.integration

MODEL = "smollm2"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
# The greedy chat answer to CAPITAL ends by itself after ~8 tokens ("The capital of France is Paris.").
GREEDY = {"temperature": 0, "max_tokens": 24}
# Completions of "The capital of France is" do not end by themselves: every token up to max_tokens is
# an engine step (~0.1 CPU-s); 6 are enough for a stream to add up to the unary text token by token.
SHORT = {"temperature": 0, "max_tokens": 6}
# min_tokens keeps the end-of-sequence token away: only a hang-up can end this in time.
ENDLESS = {"max_tokens": 1500, "extra_body": {"min_tokens": 1500}}


@pytest.fixture
def client(frontend):
    with openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0) as client:
        yield client


def run(coroutine_function, frontend):
    """Runs `coroutine_function(async_client)` on a fresh event loop."""
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0) as client:
            return await coroutine_function(client)
    return asyncio.run(main())


def at_once(*calls):
    """The results of the argument-less ``calls``, run at the same time, in order: their requests are
    independent, and the engine decodes them in the same steps (four at once cost ~2.3x one, not 4x)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


@pytest.fixture(scope="module")
def tokenizer(smollm2_engine_dir):
    from serving.tokenization import load_tokenizer
    return load_tokenizer(smollm2_engine_dir)


@contextmanager
def in_process_frontend(*flags):
    """The frontend `python -m openai_frontend <flags>` would serve, in this process; yields its base URL."""
    from openai_frontend.__main__ import config_from_arguments, parse_arguments

    with in_process_frontends({"frontend": config_from_arguments(parse_arguments(list(flags)))}) as urls:
        yield urls["frontend"]


def rendered_prompt_tokens(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=True))


TEXT_PARTS = [{"role": "system", "content": [{"type": "text", "text": "You answer in one sentence."}]},
              {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                           {"type": "text", "text": "of France?"}]}]
COMPLETION_PROMPT = "The capital of France is"
SAMPLED_N = {"model": MODEL, "messages": CAPITAL, "n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 6}
BLS_EXTRAS = {"plain": {}, "stop": {"stop": [" Paris"]}, "logprobs": {"logprobs": True, "top_logprobs": 2}}
MULTIBYTE = {"model": MODEL, "messages": [{"role": "user", "content": "海についての短い詩を日本語で書いてください。"}],
             "temperature": 0, "max_tokens": 32}


def stream_chunks(frontend, **request):
    """The chunks of one streamed chat completion through the async client."""
    async def stream(c):
        return [chunk async for chunk in await c.chat.completions.create(**request, stream=True)]
    return run(stream, frontend)


@pytest.fixture(scope="module")
def replies(frontend, bls_frontend):
    """Every request of the tests below whose answers are compared only with each other's tokens or
    text (not their log-probs to 1e-6: test_completion_logprobs_... sends those alone), sent at once
    when the first test asks: {test: [each request's answer]}. The engine batches 8 and keeps its slots
    full from the queue; all are answered before the first test reads its own, so none is still running
    in the hang-up tests' idle checks. One test after another (each test's own requests at once), these
    tests took ~37 s of CI's make test (2026-11-30)."""
    with openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=300) as client, \
            openai.OpenAI(base_url=f"{bls_frontend}/v1", api_key="unused", max_retries=0, timeout=300) as via_bls:
        chat, completion, bls_chat = client.chat.completions.create, client.completions.create, via_bls.chat.completions.create
        sends = {
            "chat": [partial(chat, model=MODEL, messages=CAPITAL, **GREEDY)],
            "text_parts": [partial(run, lambda c: c.chat.completions.create(model=MODEL, messages=TEXT_PARTS, **GREEDY),
                                   frontend)],
            "length": [partial(chat, model=MODEL, messages=CAPITAL, temperature=0, max_completion_tokens=3)],
            "streamed_deltas": [partial(chat, model=MODEL, messages=CAPITAL, **GREEDY),
                                partial(stream_chunks, frontend, model=MODEL, messages=CAPITAL,
                                        stream_options={"include_usage": True}, **GREEDY)],
            "completion_stream": [partial(completion, model=MODEL, prompt=COMPLETION_PROMPT, **SHORT),
                                  lambda: list(completion(model=MODEL, prompt=COMPLETION_PROMPT, stream=True, **SHORT))],
            "chat_logprobs": [partial(chat, model=MODEL, messages=CAPITAL, logprobs=True, top_logprobs=3, **GREEDY),
                              partial(chat, model=MODEL, messages=CAPITAL, **GREEDY)],
            "chat_logprob_entries": [partial(chat, model=MODEL, messages=CAPITAL, logprobs=True, top_logprobs=2, **GREEDY),
                                     partial(stream_chunks, frontend, model=MODEL, messages=CAPITAL, logprobs=True,
                                             top_logprobs=2, **GREEDY)],
            "n": [partial(chat, **SAMPLED_N), partial(chat, **SAMPLED_N), partial(stream_chunks, frontend, **SAMPLED_N)],
            "usage": [partial(completion, model=MODEL, prompt=["The capital of France is", "One, two, three,"], n=2,
                              max_tokens=5, temperature=0)],
            "stop": [partial(chat, model=MODEL, messages=CAPITAL, **GREEDY),
                     partial(chat, model=MODEL, messages=CAPITAL, stop=["Paris", "Berlin"], **GREEDY),
                     partial(stream_chunks, frontend, model=MODEL, messages=CAPITAL, stop="Paris", **GREEDY)],
            **{f"bls_{name}": [partial(chat, model=MODEL, messages=CAPITAL, **GREEDY, **extra),
                               partial(bls_chat, model=MODEL, messages=CAPITAL, **GREEDY, **extra),
                               lambda extra=extra: list(bls_chat(model=MODEL, messages=CAPITAL, **GREEDY, **extra,
                                                                 stream=True))]
               for name, extra in BLS_EXTRAS.items()},
            "multibyte": [partial(chat, **MULTIBYTE), lambda: list(chat(**MULTIBYTE, stream=True)),
                          lambda: list(bls_chat(**MULTIBYTE, stream=True))],
        }
        with ThreadPoolExecutor(max_workers=sum(map(len, sends.values()))) as pool:
            futures = {test: [pool.submit(send) for send in test_sends] for test, test_sends in sends.items()}
            yield {test: [future.result() for future in test_futures] for test, test_futures in futures.items()}


def test_models_lists_the_served_model(client):
    # the base model, then the session frontend's two LoRA adapters (conftest.py --lora_modules)
    assert [model.id for model in client.models.list()] == [MODEL, "sql", "chat16"]


def test_chat_answers_the_capital_question(replies, tokenizer):
    reply, = replies["chat"]
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.created > 0
    assert reply.usage.prompt_tokens == rendered_prompt_tokens(tokenizer, CAPITAL)
    assert reply.usage.completion_tokens == len(tokenizer.encode(choice.message.content, add_special_tokens=False))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_async_chat_answers_the_capital_question_with_text_parts(replies):
    reply, = replies["text_parts"]  # (through the async client: replies)
    assert "Paris" in reply.choices[0].message.content


def test_length_finish_counts_exactly_max_tokens(replies):
    reply, = replies["length"]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_streamed_deltas_concatenate_to_the_unary_text(replies):
    unary, chunks = replies["streamed_deltas"]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == unary.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == unary.choices[0].finish_reason
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage == unary.usage  # usage last, exact


def test_sync_stream_of_completions(replies):
    unary, chunks = replies["completion_stream"]
    assert "".join(chunk.choices[0].text for chunk in chunks) == unary.choices[0].text
    assert unary.object == "text_completion" and unary.id.startswith("cmpl-")


def test_chat_logprobs_name_every_generated_token(replies):
    """Greedy: one entry per completion token, the tokens spell the answer, each chosen token is
    its own top-1 alternative with the same log-prob."""
    reply, plain = replies["chat_logprobs"]
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert "Paris" in choice.message.content and len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode("utf-8"))
        best = entry.top_logprobs[0]
        assert best.token == entry.token and best.logprob == pytest.approx(entry.logprob, abs=1e-5)
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob <= 0
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_completion_logprobs_and_streamed_entries_concatenate_to_the_unary_ones(client, replies):
    prompt = COMPLETION_PROMPT

    # One after the other, each alone in the engine's steps: the log-probs are compared to 1e-6, and a
    # step of another batch size sums in another order (5e-6 apart when the two ran at once).
    unary = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, **SHORT)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, logprobs=2, stream=True, **SHORT))
    chat_unary, chat_chunks = replies["chat_logprob_entries"]  # only the tokens compared: at once
    logprobs = unary.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == unary.usage.completion_tokens
    assert "".join(logprobs.tokens) == unary.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 2 and max(top, key=top.get) == token and top[token] == pytest.approx(logprob, abs=1e-5)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert len(streamed) > 1  # entries arrive with their deltas, not at the end
    assert [t for s in streamed for t in s.tokens] == logprobs.tokens
    assert [lp for s in streamed for lp in s.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-6)
    entries = [e for c in chat_chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [(e.token, [a.token for a in e.top_logprobs]) for e in entries] == \
        [(e.token, [a.token for a in e.top_logprobs]) for e in chat_unary.choices[0].logprobs.content]


def test_too_many_top_logprobs_gets_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=CAPITAL, logprobs=True, top_logprobs=21)
    assert raised.value.body["param"] == "top_logprobs" and "top_logprobs must be in [0, 20]" in raised.value.message


def test_n_returns_distinct_choices(replies):
    reply, again, chunks = replies["n"]  # the same request twice, and streamed
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content  # seeds 7 and 8
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [c.message.content for c in reply.choices]


def test_usage_of_several_prompts_and_choices(replies, tokenizer):
    prompts = ["The capital of France is", "One, two, three,"]
    reply, = replies["usage"]
    assert len(reply.choices) == 4
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert reply.usage.completion_tokens == 4 * 5 and all(c.finish_reason == "length" for c in reply.choices)


def test_stop_cuts_the_text_before_the_stop_string(replies):
    full, cut, chunks = replies["stop"]
    full = full.choices[0].message.content
    assert "Paris" in full
    expected = full[:full.index("Paris")]
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field,value", [("temperature", 5), ("n", 0), ("top_k", "many"), ("bogus_field", 1),
                                         ("top_logprobs", 3), ("stop", [""])])
def test_bad_field_gets_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=CAPITAL, extra_body={field: value})
    assert raised.value.status_code == 400
    assert field in raised.value.message
    assert raised.value.body["param"] == field and raised.value.body["type"] == "invalid_request_error"


def test_async_bad_message_gets_a_400_naming_it(frontend):
    async def bad(c):
        with pytest.raises(openai.BadRequestError) as raised:
            await c.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
        return raised.value
    error = run(bad, frontend)
    assert "messages[0].role" in error.message and error.status_code == 400


def test_too_many_tokens_gets_a_400_naming_max_tokens(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=10**6)
    assert "max_tokens" in raised.value.message


def test_unknown_model_gets_a_404(client, frontend):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)
    assert raised.value.body["code"] == "model_not_found" and "gpt-4o" in raised.value.message

    async def unknown(c):
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="gpt-4o", prompt="Hi")
    run(unknown, frontend)


def test_unknown_route_gets_an_openai_shaped_404(frontend):
    response = requests.post(f"{frontend}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=10)
    assert response.status_code == 404 and "/v1/embeddings" in response.json()["error"]["message"]


def idle_within(server, seconds):
    return wait_for(lambda: kv_and_requests(scrape(server)) == (0.0, 0.0), timeout=seconds, interval=0.1)


def test_sync_hang_up_mid_stream_leaves_no_active_request(client, triton_server):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                                            stream=True, **ENDLESS)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()  # the client is gone, mid-stream
    assert idle_within(triton_server, 2.0), kv_and_requests(scrape(triton_server))


def test_async_hang_up_mid_stream_of_n_choices_leaves_no_active_request(frontend, triton_server):
    async def hang_up(c):
        stream = await c.completions.create(model=MODEL, prompt="Once upon a time", n=2, stream=True, **ENDLESS)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 4:
                break
        await stream.close()
    run(hang_up, frontend)
    assert idle_within(triton_server, 2.0), kv_and_requests(scrape(triton_server))


def test_unary_hang_up_leaves_no_active_request(frontend, triton_server):
    with pytest.raises(openai.APITimeoutError):
        with openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=1.0) as c:
            c.completions.create(model=MODEL, prompt="Once upon a time", **ENDLESS)
    assert idle_within(triton_server, 2.0), kv_and_requests(scrape(triton_server))


def test_concurrent_streams_with_hang_ups_all_end_and_free_everything(frontend, triton_server):
    """More streams than BLS instances (they queue in Triton), some of them abandoned mid-way."""
    async def one(c, index):
        stream = await c.completions.create(model=MODEL, prompt=f"Count to {index + 3}:", max_tokens=6,
                                            extra_body={"min_tokens": 6}, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if index % 3 == 0 and len(chunks) == 1:
                await stream.close()  # this client leaves after its first token
                return None
        return chunks[-1].usage

    async def many(c):
        return await asyncio.gather(*[one(c, i) for i in range(7)])
    usages = run(many, frontend)
    assert [u is None for u in usages] == [i % 3 == 0 for i in range(7)]
    assert all(u.completion_tokens == 6 for u in usages if u is not None)
    assert idle_within(triton_server, 5.0), kv_and_requests(scrape(triton_server))


def test_metrics_count_requests_and_leave_tritons_alone(client, frontend, triton_server):
    client.models.list()
    families = {f.name: f for f in text_string_to_metric_families(requests.get(f"{frontend}/metrics").text)}
    counted = {(s.labels["endpoint"], s.labels["status"]): s.value
               for s in families["tritonllm_openai_requests"].samples if s.name.endswith("_total")}
    assert counted[("models", "200")] >= 1 and counted[("chat_completions", "200")] >= 1
    assert counted[("chat_completions", "400")] >= 1 and counted[("chat_completions", "404")] >= 1
    assert counted[("chat_completions", "cancelled")] >= 1  # the hang-up tests above
    assert "tritonllm_openai_request_duration_seconds" in families
    triton_metrics = triton_server.metrics_text()
    assert "nv_trt_llm_request_metrics" in triton_metrics and "tritonllm_openai" not in triton_metrics


def test_unreachable_triton_gets_a_503(smollm2_engine_dir):
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there: Triton is down or still starting
    with in_process_frontend(f"--grpc_url={nowhere}", f"--tokenizer_dir={smollm2_engine_dir}",
                             f"--served_model_name={MODEL}") as url:
        assert requests.get(f"{url}/health", timeout=10).status_code == 503
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError) as raised:
                client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=4)
    assert raised.value.status_code == 503 and raised.value.body["code"] == "model_not_ready"


@pytest.fixture(scope="module")
def bls_frontend(triton_server, smollm2_engine_dir):
    """A second frontend whose requests go through tensorrt_llm_bls (text in and out) instead of
    straight to tensorrt_llm (the default: ids in and out, decoded in the frontend)."""
    with in_process_frontend(f"--grpc_url={triton_server.grpc_url}", f"--tokenizer_dir={smollm2_engine_dir}",
                             f"--served_model_name={MODEL}", "--triton_model=tensorrt_llm_bls") as url:
        assert wait_for(lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, timeout=30)
        yield url


@pytest.mark.parametrize("name", list(BLS_EXTRAS))
def test_bls_entry_answers_exactly_as_the_direct_entry(replies, name):
    extra = BLS_EXTRAS[name]
    direct, bls, streamed = replies[f"bls_{name}"]  # direct, through the BLS, and through the BLS streamed
    answers = [direct, bls]
    streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert direct.choices[0].message.content == bls.choices[0].message.content == streamed_text
    assert direct.choices[0].finish_reason == bls.choices[0].finish_reason
    assert direct.usage.completion_tokens == bls.usage.completion_tokens
    if "stop" in extra:
        assert direct.choices[0].finish_reason == "stop" and "Paris" not in direct.choices[0].message.content
    if "logprobs" in extra:
        tokens = [[(e.token, [t.token for t in e.top_logprobs]) for e in a.choices[0].logprobs.content] for a in answers]
        assert tokens[0] == tokens[1] and len(tokens[0]) >= 1


def test_multibyte_text_streams_whole_characters_direct_and_through_the_bls(replies):
    """Characters split over tokens come out whole in both entries' streams, and the pieces add up to
    the direct entry's unary answer: the direct entry decodes ids in the frontend
    (openai_frontend/detokenizer.py), the BLS a few ids per chunk (serving.tokenization.DecodeWindow
    through the postprocessing model). The three requests at once (replies): one 32-token decode for all."""
    unary, direct_chunks, bls_chunks = replies["multibyte"]
    assert unary.usage.completion_tokens == 32
    for entry, chunks in (("direct", direct_chunks), ("bls", bls_chunks)):
        streamed = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(streamed) == unary.choices[0].message.content, entry
        assert not any("\ufffd" in piece for piece in streamed), (entry, streamed)
        assert sum(1 for piece in streamed if piece) > 4, (entry, streamed)


def test_several_workers_share_the_port_and_sum_their_metrics(triton_server, smollm2_engine_dir, tmp_path):
    # Two workers: the first process and one spawned worker (openai_frontend/workers.py); a third
    # runs the same code and costs another interpreter start with its imports.
    with running_frontend(triton_server.grpc_url, smollm2_engine_dir, tmp_path, "--workers=2") as url:
        assert wait_for(lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, timeout=30)
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}

        def ask():  # a new connection each time: the kernel spreads them over the workers
            return requests.post(f"{url}/v1/completions", json=body, headers={"Connection": "close"}, timeout=60)
        responses = at_once(*[ask] * 8)
        assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
        texts = {response.json()["choices"][0]["text"] for response in responses}
        assert len(texts) == 1  # every worker answers the same
        families = {f.name: f for f in text_string_to_metric_families(requests.get(f"{url}/metrics").text)}
        counted = {(s.labels["endpoint"], s.labels["status"]): s.value
                   for s in families["tritonllm_openai_requests"].samples if s.name.endswith("_total")}
        assert counted[("completions", "200")] == 8
        port = url.rsplit(":", 1)[1]
        parent = subprocess.run(["pgrep", "-f", f"openai_frontend.*--port={port}"], capture_output=True,
                                text=True).stdout.split()
        children = subprocess.run(["pgrep", "-P", parent[0], "-f", "multiprocessing.spawn"], capture_output=True,
                                  text=True).stdout.split()
        assert len(parent) == 1 and len(children) == 1  # the first process and one spawned worker
