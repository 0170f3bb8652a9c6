"""Drives `encore serve` with the official `openai` Python client.

Usage: python openai-client.py BASE_URL   (e.g. http://127.0.0.1:8080)

Lists models, chats with and without streaming, runs completions, 8
concurrent streams, a JSON-schema answer, log-probabilities (streamed and
not), n=4 choices, a required tool call and its result, and invalid
requests; exits non-zero on the first failure. Loopback only; every call
has a timeout.
"""

import concurrent.futures
import sys
import time
import urllib.request

import openai

base = sys.argv[1].rstrip("/")
deadline = time.time() + 300
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except Exception:
        pass
    if time.time() > deadline:
        sys.exit("the server never became ready")
    time.sleep(0.2)

client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)

models = client.models.list()
ids = [m.id for m in models.data]
assert len(ids) == 1, ids
model = ids[0]
print("models:", ids)

messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
text = chat.choices[0].message.content
assert chat.choices[0].message.role == "assistant"
assert text, chat
assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 10, chat.usage
print("chat:", repr(text))

stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
pieces, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        finish = c.finish_reason or finish
assert "".join(pieces) == text, ("".join(pieces), text)
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage
assert finish in ("stop", "length"), finish
print("stream: %d chunks, usage %s" % (len(pieces), usage))

completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
assert "Paris" in completion.choices[0].text, completion
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    if c.choices
)
assert streamed == completion.choices[0].text, (streamed, completion.choices[0].text)
print("completion:", repr(completion.choices[0].text))

def one_stream(i):
    s = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count from 1 to %d." % (i + 5)}],
        max_tokens=32, temperature=0.7, seed=i, stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in s if c.choices)

with concurrent.futures.ThreadPoolExecutor(8) as pool:
    outs = list(pool.map(one_stream, range(8), timeout=300))
assert all(outs), outs
print("8 concurrent streams:", [len(o) for o in outs])

import json
import math

schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
structured = client.chat.completions.create(
    model=model, messages=messages, max_tokens=200, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
)
assert structured.choices[0].finish_reason == "stop", structured
value = json.loads(structured.choices[0].message.content)
assert set(value) == {"city", "country", "population"}, value
assert isinstance(value["population"], int) and value["population"] >= 0, value
assert len(value["city"]) <= 24 and len(value["country"]) <= 24, value
print("json schema:", value)

asked = dict(model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4)
scored = client.chat.completions.create(**asked)
tokens = scored.choices[0].logprobs.content
assert len(tokens) == scored.usage.completion_tokens, tokens
for t in tokens:
    assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-4, t
    assert t.logprob <= 0 and len(t.top_logprobs) == 4, t
streamed_tokens = []
for chunk in client.chat.completions.create(**asked, stream=True):
    for c in chunk.choices:
        if c.logprobs and c.logprobs.content:
            streamed_tokens.extend(c.logprobs.content)
assert [(t.token, round(t.logprob, 4)) for t in streamed_tokens] == [
    (t.token, round(t.logprob, 4)) for t in tokens
], (streamed_tokens, tokens)
print("logprobs:", [(t.token, round(t.logprob, 3)) for t in tokens])

several = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Tell me a story."}],
    max_tokens=16, temperature=1.0, seed=11, n=4,
)
assert [c.index for c in several.choices] == [0, 1, 2, 3], several
assert len({c.message.content for c in several.choices}) > 1, several
print("n=4:", [c.message.content[:20] for c in several.choices])

tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
}}]
question = {"role": "user", "content": "What is the weather in Paris?"}
called = client.chat.completions.create(
    model=model, messages=[question], tools=tools, tool_choice="required", max_tokens=64, temperature=0,
)
assert called.choices[0].finish_reason == "tool_calls", called
call = called.choices[0].message.tool_calls[0]
assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str), call
answered = client.chat.completions.create(
    model=model, tools=tools, max_tokens=24, temperature=0,
    messages=[question, called.choices[0].message,
              {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'}],
)
assert answered.choices[0].message.content, answered
print("tool call:", call.function.name, call.function.arguments, "->", repr(answered.choices[0].message.content))

for bad, error in [
    (dict(model="no-such-model", messages=messages), openai.NotFoundError),
    (dict(model=model, messages=messages, n=9), openai.BadRequestError),
    (dict(model=model, messages=messages, logprobs=True, top_logprobs=50), openai.BadRequestError),
    (dict(model=model, messages=messages, temperature=-3), openai.BadRequestError),
    (dict(model=model, messages=[]), openai.BadRequestError),
]:
    try:
        client.chat.completions.create(**bad)
    except error as e:
        assert e.body and e.body.get("message"), e
        print("refused as expected:", e.status_code, e.body["message"])
    else:
        sys.exit("accepted an invalid request: %r" % (bad,))
print("ok")
