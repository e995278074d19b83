"""KV-event relay for the real-vLLM mode of bench-routing (issue 13).

vLLM 0.32's ZMQ publisher binds only `tcp://*:P`, `ipc://` and `inproc://` endpoints and
connects to anything else, so N engines on 127.0.0.{2..N+1} cannot all bind the same port on
their own address. Each engine publishes on its own `ipc://` sockets instead and this relay
re-publishes them on `tcp://<engine address>:<port>` (one KV-event port for the whole fleet, as a
LoxiLB rule's `kvZmqPort` and the sim fleet expect).

Usage: python kv_event_relay.py PUB_SRC=PUB_DST[,REPLAY_SRC=REPLAY_DST] ...
  PUB_SRC     the engine's `ipc://` PUB endpoint      (relayed by an XSUB -> XPUB proxy)
  PUB_DST     `tcp://host:port` bound by the relay     (subscriptions flow back upstream)
  REPLAY_SRC  the engine's `ipc://` replay ROUTER      (optional)
  REPLAY_DST  `tcp://host:port` ROUTER bound by the relay: a request `[id, b"", start_seq]` is
              sent upstream as `[b"", start_seq]` and every reply frame set up to and including
              the end marker (empty topic) comes back to `id` as `[id, b"", ...]`.
Prints `relay ready` once every socket is bound; runs until killed.
"""
import sys
import threading

import zmq

END_WAIT_MS = 5000


def pub_proxy(ctx, src, dst):
    xsub = ctx.socket(zmq.XSUB)
    xsub.connect(src)
    xpub = ctx.socket(zmq.XPUB)
    xpub.bind(dst)
    return lambda: zmq.proxy(xsub, xpub)


def replay_proxy(ctx, src, dst):
    front = ctx.socket(zmq.ROUTER)
    front.bind(dst)

    def serve():
        while True:
            frames = front.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            back = ctx.socket(zmq.DEALER)
            back.setsockopt(zmq.RCVTIMEO, END_WAIT_MS)
            back.setsockopt(zmq.LINGER, 0)
            back.connect(src)
            back.send_multipart([b"", start])
            try:
                while True:
                    reply = back.recv_multipart()
                    front.send_multipart([client] + reply)
                    # Reply: [b"", topic, seq, payload]; the end marker has an empty topic.
                    if len(reply) >= 2 and reply[1] == b"":
                        break
            except zmq.Again:
                pass
            back.close()

    return serve


def main(argv):
    if not argv:
        sys.exit(__doc__)
    ctx = zmq.Context()
    runners = []
    for spec in argv:
        for part in spec.split(","):
            src, sep, dst = part.partition("=")
            if not sep or not src.startswith("ipc://") or not dst.startswith("tcp://"):
                sys.exit(f"kv_event_relay: bad pair {part!r} (want ipc://...=tcp://host:port)")
        parts = [p.partition("=") for p in spec.split(",")]
        runners.append(pub_proxy(ctx, parts[0][0], parts[0][2]))
        if len(parts) > 1:
            runners.append(replay_proxy(ctx, parts[1][0], parts[1][2]))
    threads = [threading.Thread(target=r, daemon=True) for r in runners]
    for t in threads:
        t.start()
    print("relay ready", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1:])
