"""Drives `encore serve`'s /v1/messages with the official `anthropic` Python client.

Usage: python anthropic-client.py BASE_URL   (e.g. http://127.0.0.1:8080)

Sends a message with a system prompt, counts its tokens, sends it
streamed (checking the events' order), stop sequences, a required tool
call and its result (whole and streamed), and invalid requests; exits
non-zero on the first failure. Loopback only; every call has a timeout.
"""

import json
import sys
import time
import urllib.request

import anthropic

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

with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
    model = json.load(r)["data"][0]["id"]

client = anthropic.Anthropic(base_url=base, api_key="unused", timeout=120, max_retries=0)
# Recent clients no longer take `temperature` as an argument; the API still does.
GREEDY = {"temperature": 0}

system = "You are a helpful assistant."
messages = [{"role": "user", "content": "What is the capital of France?"}]
message = client.messages.create(model=model, system=system, messages=messages, max_tokens=24, extra_body=GREEDY)
assert message.type == "message" and message.role == "assistant", message
assert message.id.startswith("msg_"), message
assert message.content[0].type == "text" and message.content[0].text, message
assert message.stop_reason in ("end_turn", "max_tokens"), message
assert message.usage.input_tokens > 10 and message.usage.output_tokens > 0, message.usage
text = message.content[0].text
print("message:", repr(text), message.stop_reason)
counted = client.messages.count_tokens(model=model, system=system, messages=messages)
assert counted.input_tokens == message.usage.input_tokens, (counted, message.usage)

with client.messages.stream(model=model, system=system, messages=messages, max_tokens=24, extra_body=GREEDY) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
assert streamed == text, (streamed, text)
assert final.usage.output_tokens == message.usage.output_tokens, final.usage
assert final.stop_reason == message.stop_reason, final
kinds = [e.type for e in client.messages.create(
    model=model, system=system, messages=messages, max_tokens=24, extra_body=GREEDY, stream=True)]
# (The client reads and drops the `ping` event.)
assert kinds[:2] == ["message_start", "content_block_start"], kinds
assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
assert set(kinds[2:-3]) == {"content_block_delta"}, kinds
print("stream: %d events" % len(kinds))

sea = [{"role": "user", "content": "Write a sentence about the sea."}]
full = client.messages.create(model=model, messages=sea, max_tokens=32, extra_body=GREEDY).content[0].text
words = full.split()
assert len(words) > 3, full
stop = words[len(words) // 2]
cut = client.messages.create(model=model, messages=sea, max_tokens=32, extra_body=GREEDY, stop_sequences=[stop])
assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut
assert cut.content[0].text == full[: full.index(stop)], (cut, full)
print("stop sequence:", repr(stop), "->", repr(cut.content[0].text))

tools = [{
    "name": "get_weather", "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
}]
question = {"role": "user", "content": "What is the weather in Paris?"}
asked = dict(model=model, messages=[question], tools=tools, tool_choice={"type": "any"}, max_tokens=64, extra_body=GREEDY)
called = client.messages.create(**asked)
assert called.stop_reason == "tool_use", called
use = next(b for b in called.content if b.type == "tool_use")
assert use.name == "get_weather" and isinstance(use.input["city"], str), use
assert use.id.startswith("toolu_"), use
with client.messages.stream(**asked) as stream:
    streamed_call = stream.get_final_message()
streamed_use = next(b for b in streamed_call.content if b.type == "tool_use")
assert streamed_use.input == use.input and streamed_call.stop_reason == "tool_use", streamed_call
answered = client.messages.create(
    model=model, tools=tools, max_tokens=24, extra_body=GREEDY,
    messages=[question, {"role": "assistant", "content": called.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 degrees."}]}],
)
assert answered.usage.input_tokens > called.usage.input_tokens, answered.usage
assert answered.content, answered
print("tool use:", use.name, use.input, "->", answered.stop_reason, repr(answered.content[0].text if answered.content[0].type == "text" else answered.content[0]))

image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
for bad, error in [
    (dict(model="no-such-model", messages=messages, max_tokens=8), anthropic.NotFoundError),
    (dict(model=model, messages=messages, max_tokens=0), anthropic.BadRequestError),
    (dict(model=model, messages=[{"role": "system", "content": "x"}], max_tokens=8), anthropic.BadRequestError),
    (dict(model=model, messages=[{"role": "user", "content": [image]}], max_tokens=8), anthropic.BadRequestError),
    (dict(model=model, messages=messages, max_tokens=8, tool_choice={"type": "any"}), anthropic.BadRequestError),
]:
    try:
        client.messages.create(**bad)
    except error as e:
        assert e.body["type"] == "error" and e.body["error"]["message"], e.body
        print("refused as expected:", e.status_code, e.body["error"]["type"], e.body["error"]["message"])
    else:
        sys.exit("accepted an invalid request: %r" % (bad,))
print("ok")
