"""Drives `encore serve` with the official `openai` Python client.

Usage: python openai-client.py BASE_URL   (e.g. http://127.0.0.1:8080)

Lists models, chats with and without streaming, runs completions, 8
concurrent streams and invalid requests; exits non-zero on the first
failure. Loopback only; every call has a timeout.
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

for bad, error in [
    (dict(model="no-such-model", messages=messages), openai.NotFoundError),
    (dict(model=model, messages=messages, n=2), openai.BadRequestError),
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
