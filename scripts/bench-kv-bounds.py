#!/usr/bin/env python3
"""Load driver of scripts/bench-kv-bounds.sh (issue 9 §1): floods a running loxilb's
kvExactMode-3 VIP with pathological prompts while probing ordinary requests, samples the
daemon's RSS from /proc, and measures tokenization seconds per byte from its metrics.

Modes (all bounded in time, loopback only):
  flood     --vip P --api P --pid PID --seconds S --word-mb N --chat-msgs N --conc N
  linear    --vip P --api P --pid PID --sizes-kb 32,64,...
Prints one JSON object on stdout.
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time

WORDS = ("the quick brown fox jumps over a lazy dog while cats sleep in warm sun and "
         "people read long books about rivers mountains cities history science music").split()


def text(n_bytes, seed):
    rnd = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        w = rnd.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


def post(port, path, body, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t = time.perf_counter()
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    dt = time.perf_counter() - t
    c.close()
    return r.status, dt


def metrics(api):
    c = http.client.HTTPConnection("127.0.0.1", api, timeout=30)
    c.request("GET", "/netlox/v1/metrics")
    body = c.getresponse().read().decode()
    c.close()
    return body


def metric(body, prefix):
    total = 0.0
    for line in body.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_kb(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Sampler(threading.Thread):
    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_kb(self.pid))
            time.sleep(0.02)


def probe(vip, until, seed):
    """Sequential ordinary requests (unique ~2 KB prompts) until `until`: latencies (s)."""
    lat, i, errors = [], 0, 0
    while time.monotonic() < until:
        body = json.dumps({"model": "tiny", "prompt": f"probe {seed} {i} " + text(2048, seed * 100000 + i)})
        status, dt = post(vip, "/v1/completions", body)
        if status != 200:
            errors += 1
        lat.append(dt)
        i += 1
    return lat, errors


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(lat):
    return {"n": len(lat), "p50_ms": round(pct(lat, 0.5) * 1e3, 2),
            "p99_ms": round(pct(lat, 0.99) * 1e3, 2),
            "mean_ms": round(statistics.fmean(lat) * 1e3, 2) if lat else None}


def flood(a):
    """Baseline probes, then probes while 2 x conc separate curl processes loop the flood
    requests (separate processes: the probe's own latency is not the client's)."""
    import os
    import subprocess
    import tempfile
    tmp = tempfile.mkdtemp(prefix="kv-bounds-")
    files = {"word": os.path.join(tmp, "word.json"), "chat": os.path.join(tmp, "chat.json")}
    with open(files["word"], "w") as f:
        json.dump({"model": "tiny", "prompt": "a" * (a.word_mb << 20)}, f)
    with open(files["chat"], "w") as f:
        json.dump({"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * a.chat_msgs}, f)
    reasons = ("oversize", "overload", "budget", "no_worker", "tokenize")
    sampler = Sampler(a.pid)
    sampler.start()
    base_lat, base_err = probe(a.vip, time.monotonic() + a.seconds, 1)
    rss_idle = sampler.peak
    before = metrics(a.api)
    procs = []
    for kind, path in (("word", "/v1/completions"), ("chat", "/v1/chat/completions")):
        for i in range(a.conc):
            out = os.path.join(tmp, f"{kind}-{i}.txt")
            loop = (f'end=$((SECONDS+{int(a.seconds)})); while [ $SECONDS -lt $end ]; do '
                    f'curl -s -o /dev/null -w "%{{http_code}} %{{time_total}}\\n" --max-time 120 '
                    f'-H "Content-Type: application/json" --data-binary @{files[kind]} '
                    f'http://127.0.0.1:{a.vip}{path} >> {out}; done')
            procs.append((kind, out, subprocess.Popen(["bash", "-c", loop])))
    time.sleep(0.5)
    load_lat, load_err = probe(a.vip, time.monotonic() + a.seconds - 1, 2)
    for _, _, pr in procs:
        pr.wait(timeout=300)
    sampler.stop.set()
    sampler.join()
    after = metrics(a.api)
    results = {"word": [], "chat": []}
    for kind, out, _ in procs:
        if os.path.exists(out):
            for line in open(out):
                st, dt = line.split()
                results[kind].append((int(st), float(dt)))
    miss = {r: metric(after, f'loxilb_pd_kv_tier15_miss_reason_total{{service="1",reason="{r}"}}')
            - metric(before, f'loxilb_pd_kv_tier15_miss_reason_total{{service="1",reason="{r}"}}')
            for r in reasons}
    out = {
        "word_bytes": os.path.getsize(files["word"]), "chat_bytes": os.path.getsize(files["chat"]),
        "concurrency_each": a.conc,
        "rss_peak_mb": round(sampler.peak / 1024, 1), "rss_idle_peak_mb": round(rss_idle / 1024, 1),
        "vm_hwm_mb": round(rss_kb(a.pid, "VmHWM") / 1024, 1),
        "probe_baseline": summary(base_lat), "probe_under_flood": summary(load_lat),
        "probe_errors": base_err + load_err,
        "flood": {k: {"n": len(v), "non_200": sum(1 for s, _ in v if s != 200),
                      "p50_s": round(pct([d for _, d in v], 0.5), 3)} for k, v in results.items()},
        "miss_reason_delta": miss,
    }
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))
    os.rmdir(tmp)
    print(json.dumps(out, indent=1))


def linear(a):
    key = 'loxilb_kv_routing_stage_seconds_sum{stage="Tokenize"}'
    cnt = 'loxilb_kv_routing_stage_seconds_count{stage="Tokenize"}'
    rows = []
    for kb in [int(x) for x in a.sizes_kb.split(",")]:
        per = []
        for rep in range(a.reps):
            body = json.dumps({"model": "tiny", "prompt": f"lin {kb} {rep} " + text(kb << 10, kb * 1000 + rep)})
            m0 = metrics(a.api)
            status, _ = post(a.vip, "/v1/completions", body)
            # The job records its stage when it ends (after the request if it outlived the budget).
            for _ in range(600):
                m1 = metrics(a.api)
                if metric(m1, cnt) > metric(m0, cnt):
                    break
                time.sleep(0.05)
            per.append(metric(m1, key) - metric(m0, key))
        s = min(per)
        rows.append({"kb": kb, "tokenize_s": round(s, 4), "ns_per_byte": round(s * 1e9 / (kb << 10), 1),
                     "status": status})
    print(json.dumps({"rows": rows, "vm_hwm_mb": round(rss_kb(a.pid, "VmHWM") / 1024, 1)}, indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["flood", "linear"])
    p.add_argument("--vip", type=int, required=True)
    p.add_argument("--api", type=int, required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--word-mb", type=int, default=30)
    p.add_argument("--chat-msgs", type=int, default=400000)
    p.add_argument("--conc", type=int, default=8)
    p.add_argument("--sizes-kb", default="32,64,128,256,512,1000")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    (flood if a.mode == "flood" else linear)(a)


if __name__ == "__main__":
    main()
