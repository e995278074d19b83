#!/usr/bin/env python3
"""A real libzmq (pyzmq) KV-event publisher for loxi's tests, driven line by line on stdin.

Binds an XPUB (behaves as vLLM's PUB; XPUB only adds subscription notifications so tests can
wait for the subscriber instead of sleeping) on <host>:<port> (default 127.0.0.1) and, with --replay, a ROUTER
that answers vLLM's replay protocol from the buffer of sent batches (after --replay-delay-ms,
so tests can watch a subscriber catching up):
  request  [identity, b"", start_seq (8 bytes BE)]
  replies  [identity, b"", topic, seq, payload] per batch >= start  (--layout 3, vLLM 0.32)
           [identity, b"", seq, payload]                           (--layout 2, older engines)
  end      [identity, b"", b"", ff*8, b""]                           (layout 3)
           [identity, b"", ff*8, b""]                                (layout 2)

stdout: "ready <pub_port> <replay_port>" once bound, "subscribed" when a SUB subscribes,
"ok" after each command. stdin commands (JSON, one per line):
  {"op": "send", "seq": N, "payload_hex": "...", "topic": "kv"}   publish [topic, seq, payload]
  {"op": "skip", "seq": N, "payload_hex": "..."}                  buffer for replay, do not publish
  {"op": "raw", "frames_hex": ["..", ".."]}                       publish arbitrary frames
  {"op": "restart", "down_ms": 0, "skip": [{"seq": N, "payload_hex": ".."}, ..]}
                                   close both sockets, stay down down_ms, empty the buffer (a new
                                   engine), buffer the `skip` batches (published while no
                                   subscriber was connected: replay has them), rebind on the same
                                   ports
  {"op": "drop", "down_ms": 0, "skip": [..]}
                                   the same, keeping the buffer (the same engine; only the
                                   connections dropped)
  {"op": "exit"}
"""
import argparse
import json
import sys
import threading
import time

import zmq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--replay-port", type=int, default=0)
    ap.add_argument("--replay-delay-ms", type=int, default=0)
    ap.add_argument("--layout", type=int, default=3, choices=[2, 3])
    args = ap.parse_args()

    ctx = zmq.Context()
    lock = threading.Lock()
    state = {"buffer": [], "pub": None, "router": None, "stop": False}

    def bind(sock, port):
        if port:
            for _ in range(200):  # the old socket's port may take a moment to be released
                try:
                    sock.bind(f"tcp://{args.host}:{port}")
                    return port
                except zmq.ZMQError:
                    time.sleep(0.01)
            sock.bind(f"tcp://{args.host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{args.host}")

    def open_sockets(pub_port, replay_port):
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub_port = bind(pub, pub_port)
        router = None
        if args.replay:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            replay_port = bind(router, replay_port)
        state["pub"], state["router"] = pub, router
        return pub_port, replay_port

    pub_port, replay_port = open_sockets(args.port, args.replay_port)
    print(f"ready {pub_port} {replay_port}", flush=True)

    def serve():
        while not state["stop"]:
            with lock:
                pub, router = state["pub"], state["router"]
                socks = [s for s in (pub, router) if s is not None]
                poller = zmq.Poller()
                for s in socks:
                    poller.register(s, zmq.POLLIN)
                # Short poll under the lock, then a pause outside it (below): the command
                # thread must get the lock promptly (a lock held across long polls starved it,
                # making each command wait up to the poll timeout or longer).
                events = dict(poller.poll(1))
                if pub in events:
                    msg = pub.recv()
                    if msg[:1] == b"\x01":
                        print("subscribed", flush=True)
                if router is not None and router in events:
                    ident, _empty, start = router.recv_multipart()
                    start = int.from_bytes(start, "big")
                    time.sleep(args.replay_delay_ms / 1000)
                    for seq, topic, payload in state["buffer"]:
                        if seq >= start:
                            s = seq.to_bytes(8, "big")
                            if args.layout == 3:
                                router.send_multipart([ident, b"", topic, s, payload])
                            else:
                                router.send_multipart([ident, b"", s, payload])
                    end = b"\xff" * 8
                    if args.layout == 3:
                        router.send_multipart([ident, b"", b"", end, b""])
                    else:
                        router.send_multipart([ident, b"", end, b""])
            time.sleep(0.001)

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        with lock:
            if op in ("send", "skip"):
                topic = cmd.get("topic", "kv").encode()
                payload = bytes.fromhex(cmd["payload_hex"])
                seq = int(cmd["seq"])
                state["buffer"].append((seq, topic, payload))
                if op == "send":
                    state["pub"].send_multipart([topic, seq.to_bytes(8, "big"), payload])
            elif op == "raw":
                state["pub"].send_multipart([bytes.fromhex(f) for f in cmd["frames_hex"]])
            elif op in ("restart", "drop"):
                state["pub"].close(0)
                if state["router"] is not None:
                    state["router"].close(0)
                if op == "restart":
                    state["buffer"] = []
                for b in cmd.get("skip", []):
                    state["buffer"].append((int(b["seq"]), b"kv", bytes.fromhex(b["payload_hex"])))
                time.sleep(cmd.get("down_ms", 0) / 1000)
                open_sockets(pub_port, replay_port)
            elif op == "exit":
                break
        print("ok", flush=True)
    state["stop"] = True
    t.join(1)


if __name__ == "__main__":
    main()
