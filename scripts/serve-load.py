"""Load for an OpenAI-compatible server: aggregate generated tokens per
second and time to first token at given numbers of concurrent streams.

Usage: python3 serve-load.py URL LABEL [--streams 1,8,32,64]
                             [--prompt-words N] [--gen 128] [--rounds 2]

Each of N streams sends `rounds` streaming completions one after another
(a distinct prompt each, `gen` tokens with ignore_eos); the aggregate is
all generated tokens over the wall time of the level. One JSON line per
level on stdout; a progress line on stderr. Loopback only; every request
has a timeout and every level a bounded count.
"""

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.parse
import http.client

p = argparse.ArgumentParser()
p.add_argument("url")
p.add_argument("label")
p.add_argument("--streams", default="1,8,32,64")
p.add_argument("--prompt-words", type=int, default=110)
p.add_argument("--gen", type=int, default=128)
p.add_argument("--rounds", type=int, default=2)
a = p.parse_args()
u = urllib.parse.urlparse(a.url)
assert u.hostname in ("127.0.0.1", "localhost"), "loopback only"
_c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
_c.request("GET", "/v1/models")
MODEL = json.loads(_c.getresponse().read())["data"][0]["id"]
_c.close()
failures = []

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls "
         "watch from old oak trees near the quiet river bank at dawn").split()


def prompt(i):
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(a.prompt_words)]
    return "Request %d. " % i + " ".join(words)


def one(i, out):
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({
        "model": MODEL, "prompt": prompt(i), "max_tokens": a.gen,
        "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    })
    t0 = time.time()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, (r.status, r.read()[:300])
    first, tokens, pieces = None, None, 0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        d = json.loads(line[6:])
        if d.get("usage"):
            tokens = d["usage"]["completion_tokens"]
        for ch in d.get("choices", []):
            if ch.get("text"):
                pieces += 1
                if first is None:
                    first = time.time() - t0
    c.close()
    out.append((first if first is not None else time.time() - t0, tokens if tokens is not None else pieces))


for n in [int(x) for x in a.streams.split(",")]:
    results, threads, ends = [], [], []
    t0 = time.time()

    def worker(k):
        try:
            for r in range(a.rounds):
                one(1000 * n + k * a.rounds + r, results)
        except Exception as e:
            failures.append(repr(e))
        ends.append(time.time())

    for k in range(n):
        t = threading.Thread(target=worker, args=(k,), daemon=True)
        t.start()
        threads.append(t)
    total = n * a.rounds
    while any(t.is_alive() for t in threads):
        time.sleep(0.05)
        if int((time.time() - t0) * 20) % 10 == 0:
            sys.stderr.write("\r%s %d streams: %d/%d requests, %.0f s " % (a.label, n, len(results), total, time.time() - t0))
            sys.stderr.flush()
        if time.time() - t0 > 900:
            sys.exit("level %d did not finish in 900 s" % n)
    # The level ends when its last stream does (not when the poll saw it).
    wall = max(ends) - t0
    sys.stderr.write("\n")
    if failures:
        sys.exit("requests failed: %s" % failures[:3])
    ttft = sorted(r[0] for r in results)
    gen = sum(r[1] for r in results)
    print(json.dumps({
        "server": a.label, "streams": n, "requests": len(results),
        "generated_tokens": gen, "seconds": round(wall, 3),
        "tokens_per_second": round(gen / wall, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
        "ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
    }), flush=True)
