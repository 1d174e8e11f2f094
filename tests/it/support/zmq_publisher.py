#!/usr/bin/env python3
"""Scripted libzmq publisher for tests/it/zmq_subscription.rs (feature `real-peers`).

Reads one JSON command per line on stdin and answers each with one JSON line on stdout:
  {"op": "bind", "type": "xpub"|"pub"|"sub", "port": 0}  -> {"port": N}   (0 = ephemeral)
  {"op": "await_subscriptions", "count": N}               -> {"subscriptions": [hex, ...]} (XPUB)
  {"op": "send", "messages": [[hex frame, ...], ...]}     -> {"sent": N}
  {"op": "close"}                                          -> {"closed": true}
  {"op": "exit"}                                           -> {"bye": true}
Needs pyzmq (CONTINUUM_PYTHON points at an interpreter that has it).
"""

import json
import sys
import time

import zmq

SOCKET_TYPES = {"xpub": zmq.XPUB, "pub": zmq.PUB, "sub": zmq.SUB}


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def bind(ctx, kind, port):
    sock = ctx.socket(SOCKET_TYPES[kind])
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100000)
    if kind == "xpub":
        # Report every subscription, including repeats from reconnecting subscribers.
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    if port == 0:
        return sock, sock.bind_to_random_port("tcp://127.0.0.1")
    # A restarted publisher rebinds its old port; the previous listener closes asynchronously.
    deadline = time.monotonic() + 5
    while True:
        try:
            sock.bind("tcp://127.0.0.1:%d" % port)
            return sock, port
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def main():
    ctx = zmq.Context()
    sock = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "bind":
            sock, port = bind(ctx, cmd.get("type", "xpub"), cmd.get("port", 0))
            reply({"port": port})
        elif op == "await_subscriptions":
            subs = [sock.recv().hex() for _ in range(cmd.get("count", 1))]
            reply({"subscriptions": subs})
        elif op == "send":
            for frames in cmd["messages"]:
                sock.send_multipart([bytes.fromhex(f) for f in frames])
            reply({"sent": len(cmd["messages"])})
        elif op == "close":
            sock.close(0)
            sock = None
            reply({"closed": True})
        elif op == "exit":
            reply({"bye": True})
            break
    ctx.destroy(0)


if __name__ == "__main__":
    main()
