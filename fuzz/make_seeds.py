#!/usr/bin/env python3
"""Writes the seed corpora of fuzz/corpus/<target>/ from the repository's fixtures (real Dynamo
1.6.1 ZMQ captures and etcd records, the config examples, the kv-events vectors) and a few
hand-written inputs per format. Run from the repository root; scripts/fuzz.sh grows and
minimises the corpora from these seeds. Seed files are named seed-*, so a rerun replaces them."""

import glob
import hashlib
import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def put(target, data):
    if isinstance(data, str):
        data = data.encode()
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    name = "seed-" + hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def frames_of(prefix):
    return [open(f, "rb").read() for f in sorted(glob.glob(prefix + ".frame*.bin"))]


def zmtp_message(frames):
    out = b""
    for i, body in enumerate(frames):
        flags = (1 if i + 1 < len(frames) else 0) | (2 if len(body) > 255 else 0)
        size = len(body).to_bytes(8 if len(body) > 255 else 1, "big")
        out += bytes([flags]) + size + body
    return out


rng = random.Random(35)
BODY = '{"model":"m","messages":[{"role":"user","content":"x"}]}'

# --- fast server heads (fast_head takes a max-body byte first) ---
heads = [
    f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(BODY)}\r\n\r\n{BODY}",
    f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(BODY)}\r\n\r\n{BODY}"
    "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "POST /v1/completions?x=1 HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    "Connection: keep-alive, close\r\nContent-Length: 2\r\n\r\n{}",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 1, 1\r\n\r\n{",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nUpgrade: h2c\r\nConnection: Upgrade\r\nContent-Length: 0\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    "GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n",
    "POST /v1/chat/completions?a=\"<>\" HTTP/1.1\r\nHost: a b/c\r\nContent-Length: 0\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.1\r\nTransfer_Encoding: chunked\r\nContent_Length: 0\r\nContent-Length: 0\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Empty:\r\nX-Obs: \x80\xff\r\nContent-Length: 0\r\n\r\n",
    "POST /v1/chat/completions HTTP/1.1\nHost: r\nContent-Length: 0\n\n",
    "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]
for h in heads:
    put("fast_head", b"\x08" + h.encode("latin-1"))
    put("fast_head_vs_hyper", h.encode("latin-1"))

# --- backend responses (method byte, seed byte, then the bytes) ---
responses = [
    "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    "5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: y\r\n\r\n",
    "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    "HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n",
    "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
    "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n0\r\n\r\n",
    "HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\nabc",
    "HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\nConnection: close, x-foo\r\nX-Foo: 1\r\nKeep-Alive: timeout=5\r\n\r\nabc",
    "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
    "HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    "HTTP/1.1 502 Bad Gateway\r\n\r\nuntil close",
    "HTTP/1.1 200 OK\nContent-Length: 1\n\nx",
]
for i, r in enumerate(responses):
    put("h1_response", bytes([i % 4, i * 37 % 256]) + r.encode())

chunked = [
    "5\r\nhello\r\n0\r\n\r\n",
    "5 \t;a=b;c\r\nhello\r\nA\r\n0123456789\r\n0\r\nT: v\r\nU: w\n\r\n",
    "0\r\n\r\n",
    "0000000000000001\r\nx\r\n0\r\n\r\n",
    "00000000000000001\r\nx\r\n0\r\n\r\n",
    "5\nhello\r\n0\r\n\r\n",
    "5\r\nhello\n0\r\n\r\n",
    "ffffffffffffffff\r\nabc",
    "1;\n\r\nx\r\n0\r\n\r\n",
    "3\r\nabc\r\n0\r\n\n\r\n",
    "-1\r\n",
    "0x5\r\nhello\r\n0\r\n\r\n",
]
for i, c in enumerate(chunked):
    put("h1_chunked_vs_reference", bytes([i * 11 % 256]) + c.encode())

sse = [
    'data: {"id":"1","choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n',
    'data:{"a":1}\r\n\r\n: comment\r\nevent: x\r\nid: 3\r\ndata: one\r\ndata:  two\r\n\r\n',
    "data: a\rdata: b\r\rdata: c\n\ndata: unfinished",
    "data\n\ndata:\n\n\n\ndata: x\r",
    'retry: 10\nid\nevent: kv_events\ndata: {"events":[]}\n\n',
]
for i, s in enumerate(sse):
    put("relay_sse_vs_reference", bytes([i, 40]) + s.encode())

listener = [
    'id: 5\nevent: kv_events\ndata: {"events":[]}\n\n',
    'event: reset\ndata: {"reason":"evicted","oldest_event_id":9}\n\n',
    'event: reset\r\ndata: {"reason":"whatever"}\r\n\r\n',
    "id: x\nevent: kv_events\ndata: {}\n\n: ping\n\n",
    "event: other\rdata: 1\r\rid: 18446744073709551616\n\n",
    "data: a\ndata: b\n\n",
]
for path in glob.glob(os.path.join(ROOT, "protocol/tests/data/kv/kv_events.json")):
    doc = json.load(open(path))

for i, s in enumerate(listener):
    put("kv_listener_sse", bytes([i, 30]) + s.encode())

# --- config ---
for path in sorted(glob.glob(os.path.join(ROOT, "src/config/*.yaml"))):
    put("config_yaml", open(path, "rb").read())
for text in [
    "",
    "server:\n  listen: 0.0.0.0:8080\n",
    "backends:\n  - name: a\n    url: http://127.0.0.1:9000\n    weight: ${W}\n",
    "a: &x [1, 2]\nb: *x\n",
    "server: {idle_timeout: 60s, header_read_timeout: 10s}\n",
    "dynamo:\n  discovery:\n    etcd:\n      endpoints: [http://127.0.0.1:2379]\n  namespace: dynamo\n",
]:
    put("config_yaml", text)

# --- ZMQ captures: ZMTP streams, envelopes, payloads ---
prefixes = sorted({p.rsplit(".frame", 1)[0]
                   for p in glob.glob(os.path.join(ROOT, "tests/fixtures/dynamo-1.6.1/zmq/*/*.frame0.bin"))})
kinds = {"kv_metrics": [], "kv-events": []}
for p in prefixes:
    fr = frames_of(p)
    if len(fr) != 4:
        continue
    kind = "kv_metrics" if "kv_metrics" in p else "kv-events"
    kinds[kind].append(fr)
for kind, messages in kinds.items():
    for fr in messages[:4]:
        mode = 0 if kind == "kv_metrics" else 2
        put("zmtp", bytes([mode, 7]) + zmtp_message(fr))
        envelope = fr[3][5:]
        put("load_sample", envelope)
        put("msgpack_vs_rmpv", envelope)
        put("load_sample", bytes([len(fr[0]), len(fr[1]), len(fr[2])]) + b"".join(fr))
    if messages:
        put("zmtp", bytes([mode, 3]) + b"".join(zmtp_message(f) for f in messages[:6]))
# The payloads inside the envelopes (ActiveLoad, RouterEvent arrays): decoded by the targets.
import struct  # noqa: E402


def payload_of(envelope):
    i = envelope.find(b"payload")
    if i < 0:
        return None
    j = i + len("payload")
    marker = envelope[j]
    if marker == 0xC4:
        n = envelope[j + 1]
        return envelope[j + 2:j + 2 + n]
    if marker == 0xC5:
        n = struct.unpack(">H", envelope[j + 1:j + 3])[0]
        return envelope[j + 3:j + 3 + n]
    return None


for kind, messages in kinds.items():
    for fr in messages[:6]:
        payload = payload_of(fr[3][5:])
        if payload:
            put("load_sample", payload)
            put("msgpack_vs_rmpv", payload)
            if kind == "kv-events":
                put("kv_events", payload)
put("zmtp", bytes([0x80, 1]) + b"\xff" + b"\x00" * 8 + b"\x7f\x03\x01NULL" + b"\x00" * 48)
for raw in [b"\x00", b"\xc0", b"\xcf" + b"\xff" * 8, b"\xd3\x80" + b"\x00" * 7, b"\xd9\x03abc",
            b"\xc4\x02xy", b"\xc7\x01\x05z", b"\x92\x01\xa1a", b"\x81\xa1k\x90", b"\xdd\x00\x00\x00\x02\x01\x02",
            b"\x91" * 40 + b"\x00", b"\xc1", b"\xdb\xff\xff\xff\xff"]:
    put("msgpack_vs_rmpv", raw)

# --- event bus control channel ---
lines = [
    {"type": "hello", "role": "broker", "client_id": "broker-a", "versions": [1], "dynamo_namespaces": ["dynamo"]},
    {"type": "hello", "role": "kv_listener", "client_id": "listener-a", "versions": [1, 2], "sources": [{"backend": "vllm-a"}]},
    {"type": "hello", "role": "broker", "client_id": "broker-a", "versions": [1], "dynamo_namespaces": ["dynamo", "dynamo"]},
    {"type": "heartbeat", "seq": 1},
    {"type": "draining"},
    {"type": "unsubscribe", "stream_id": 3},
]
for i, line in enumerate(lines):
    put("event_bus_ndjson_hello", bytes([i, 40]) + (json.dumps(line) + "\r\n").encode())
put("event_bus_ndjson_hello", bytes([5, 40]) + b"".join((json.dumps(l) + "\n\n").encode() for l in lines))

# --- JSON ---
for text in [
    BODY, '{"a":1,"a":2,"b":[1,2.5,-3,1e400]}', '"\\ud83d\\ude00 \\u0000 \\n"', "[[[[[]]]]]",
    '{"model":"m","model":"n","input":[{"type":"message"}]}', "18446744073709551616", "-0", "1.0e-7",
    '"\\ud800"', "{} x", " null ",
]:
    put("json_vs_serde_json", text)
for path in sorted(glob.glob(os.path.join(ROOT, "tests/fixtures/vectors/*.json"))):
    data = open(path, "rb").read()
    if len(data) <= 16384:
        put("json_vs_serde_json", data)

# --- structured targets: random bytes ---
for target in ["anthropic", "responses", "discovery", "kube_metadata"]:
    for n in [16, 64, 128, 256, 512, 1024]:
        put(target, bytes(rng.randrange(256) for _ in range(n)))

# --- Kubernetes metadata: op byte, 2-byte length, JSON document ---
examples = json.load(open(os.path.join(ROOT, "protocol/src/kube/testdata/discovery_examples_kube.json")))
dwm = json.dumps(examples["kubernetes_dwm_example"], separators=(",", ":")).encode()
slice_doc = json.dumps({"metadata": {"name": "s"}, "endpoints": [{"conditions": {"ready": True},
                        "targetRef": {"kind": "Pod", "name": "worker-0",
                                      "uid": "6f1c2a9e-3b7d-4c1e-9a51-0d2f7e8b4c33"}}]}).encode()


def doc(op, body):
    return bytes([op]) + len(body).to_bytes(2, "big") + body


if len(dwm) <= 2048:
    put("kube_metadata", doc(0, dwm) + doc(2, slice_doc) + doc(5, b"") + doc(3, b"worker-0"))
    put("kube_metadata", doc(2, slice_doc) + doc(0, dwm) + doc(4, b"s"))
