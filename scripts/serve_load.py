#!/usr/bin/env python
"""A bounded load run of ``cepe serve`` on loopback, plus fault runs; writes JSON + markdown.

Steps (every loop has a fixed count or a deadline; the server is started and stopped here):

1. Fault: a killed ``cepe context add``: one document is added, then ``context add`` is killed (SIGKILL)
   once while encoding and once as soon as its staging file appears (mid-write); the store must list
   exactly what it listed before, and the staging left-over must be gone after the next open.
2. The server is started on 127.0.0.1 (free port) with a small queue; the documents are uploaded with
   ``POST /v1/contexts``; resident memory is read from ``/health``.
3. Load: ``--clients`` threads send ``--requests`` streaming chat requests in all, each over one stored
   context; a 429 (queue full, intended) is retried after a short pause, anything else that is not a
   complete stream counts as an error. Reported: requests/s, p50/p95 time to first token and total
   latency, 429 count, error count, resident memory before and after.
4. Faults against the running server: a client that disconnects mid-stream (generation must stop and
   the server go idle), and a corrupted store file (refused with a message; the server stays up).
5. Graceful shutdown with a stream in flight (it must finish; the process must exit).

Usage: python scripts/serve_load.py [--model adapters/smollm2-135m-cepe] [--out results/serve]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
QUESTIONS = [
    "What is this document about?",
    "Which command trains the adapter?",
    "Summarise the first section in one sentence.",
    "What does the benchmark measure?",
    "Which decoder is the default?",
    "What are the limits of the shipped adapter?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


class Client:
    def __init__(self, port: int) -> None:
        self.port = port

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 300):
        headers = dict(headers or {})
        if isinstance(body, dict):
            body = json.dumps(body)
            headers["Content-Type"] = "application/json"
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=headers)
            r = c.getresponse()
            raw = r.read()
            try:
                data = json.loads(raw)
            except json.JSONDecodeError:
                data = raw.decode("utf-8", "replace")
            return r.status, data, dict(r.getheaders())
        finally:
            c.close()

    def health(self) -> dict:
        return self.request("GET", "/health", timeout=30)[1]

    def stream_chat(self, body: dict, timeout: float = 600) -> dict:
        """One streaming chat request: ``{"status", "ttft_s", "total_s", "tokens", "done", "retry_after"}``."""
        t0 = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(
                "POST",
                "/v1/chat/completions",
                json.dumps({**body, "stream": True}),
                {"Content-Type": "application/json"},
            )
            r = c.getresponse()
            out = {
                "status": r.status,
                "ttft_s": None,
                "done": False,
                "retry_after": r.getheader("retry-after"),
            }
            if r.status != 200:
                out["error"] = r.read().decode("utf-8", "replace")[:300]
                return out
            pieces = 0
            for _ in range(100000):  # bounded: at most this many lines
                line = r.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out["done"] = True
                    break
                ev = json.loads(payload)
                if "error" in ev:
                    out["error"] = ev["error"]["message"]
                    break
                if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                    pieces += 1
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                if ev["choices"] and ev["choices"][0].get("finish_reason"):
                    out["finish_reason"] = ev["choices"][0]["finish_reason"]
                    out["cepe"] = ev.get("cepe")
            out["total_s"] = time.perf_counter() - t0
            out["pieces"] = pieces
            return out
        finally:
            c.close()


def cli(args: list[str], model: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "cepe.cli", *args, "--model", model], env=env, cwd=REPO, text=True, **kw
    )


def store_listing(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "contexts").iterdir()) if (store / "contexts").is_dir() else []


def check_outcome(store: Path, before: list[str]) -> str:
    """What a killed writer left: ``unchanged``, ``added (complete, hash verified)`` or ``BROKEN ...``;
    a complete addition is removed again so that the next run starts from the same store."""
    from cepe.store import ContextStore, StoreError

    now = store_listing(store)
    lost = sorted(set(before) - set(now))
    added = sorted(set(now) - set(before))
    if lost:
        return f"BROKEN: lost {lost}"
    opened = ContextStore(store)  # also removes the staging files of writers that no longer run
    for name in added:
        try:
            opened.load(name.removesuffix(".safetensors"))
        except StoreError as err:
            return f"BROKEN: {err}"
        (store / "contexts" / name).unlink()
    return "added (complete, hash verified)" if added else "unchanged"


def fault_killed_add(store: Path, docs: list[Path], model: str, work: Path) -> dict:
    """Kill ``context add`` while encoding and while writing; the store must hold either what it held
    or the complete new document, never a partial one."""
    t0 = time.perf_counter()
    p = cli(
        ["context", "add", str(docs[0]), "--store", str(store)],
        model,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, err = p.communicate(timeout=600)
    first_add_s = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"context add failed: {err}")
    before = store_listing(store)
    big = work / "big.txt"
    big.write_text("\n\n".join(d.read_text() for d in docs) * 6)
    result = {"first_add_s": round(first_add_s, 2), "listing_before": before, "runs": []}
    tmp_dir = store / "tmp"
    # (a) killed at 90 % of the first add's time (model loaded; encoding the larger document)
    p = cli(
        ["context", "add", str(big), "--store", str(store)],
        model,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.9 * first_add_s)
    alive = p.poll() is None
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    staging = len(list(tmp_dir.iterdir())) if tmp_dir.is_dir() else 0
    result["runs"].append(
        {
            "when": "while encoding",
            "killed_while_running": alive,
            "staging_files_left": staging,
            "outcome": check_outcome(store, before),
            "staging_after_reopen": len(list(tmp_dir.iterdir())) if tmp_dir.is_dir() else 0,
        }
    )
    # (b) killed as soon as its staging file exists (mid-write or between write and rename)
    for attempt in range(3):
        doc = work / f"write-{attempt}.txt"
        doc.write_text(big.read_text() + f"\n{attempt}")
        p = cli(
            ["context", "add", str(doc), "--store", str(store)],
            model,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        caught = False
        deadline = time.monotonic() + 600
        while p.poll() is None and time.monotonic() < deadline:
            if tmp_dir.is_dir() and any(f.name.startswith(f".tmp-{p.pid}-") for f in tmp_dir.iterdir()):
                p.send_signal(signal.SIGKILL)
                caught = True
                break
            time.sleep(0.002)
        p.wait(60)
        staging = len(list(tmp_dir.iterdir())) if tmp_dir.is_dir() else 0
        result["runs"].append(
            {
                "when": "staging file present (writing)",
                "attempt": attempt,
                "killed_mid_write": caught,
                "staging_files_left": staging,
                "outcome": check_outcome(store, before),
                "staging_after_reopen": len(list(tmp_dir.iterdir())) if tmp_dir.is_dir() else 0,
            }
        )
        if caught:
            break
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="adapters/smollm2-135m-cepe")
    ap.add_argument("--docs", nargs="+", default=["README.md", "docs/DESIGN.md", "docs/BENCH.md"])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-queue", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--deadline", type=float, default=900, help="seconds after which clients take no new requests"
    )
    ap.add_argument("--out", default="results/serve")
    args = ap.parse_args()
    docs = [REPO / d if not Path(d).is_absolute() else Path(d) for d in args.docs]
    result: dict = {"config": vars(args) | {"docs": [str(Path(d)) for d in args.docs]}}
    with tempfile.TemporaryDirectory(prefix="cepe-serve-load-") as tmp:
        work = Path(tmp)
        store = work / "store"
        print("== fault: killed context add", flush=True)
        result["fault_killed_add"] = fault_killed_add(store, docs, args.model, work)
        print(json.dumps(result["fault_killed_add"], indent=1), flush=True)

        port = free_port()
        log = open(work / "server.log", "w+")
        server = cli(
            ["serve", "--store", str(store), "--port", str(port), "--max-queue", str(args.max_queue)]
            + ["--threads", str(args.threads), "--max-new-tokens", "256", "--shutdown-grace", "60"],
            args.model,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        client = Client(port)
        try:
            t0 = time.perf_counter()
            for _ in range(1200):
                if server.poll() is not None:
                    raise RuntimeError("server exited at start")
                with contextlib.suppress(OSError):
                    if client.request("GET", "/health", timeout=5)[0] == 200:
                        break
                time.sleep(0.25)
            result["server_start_s"] = round(time.perf_counter() - t0, 2)
            result["rss_start_bytes"] = client.health()["rss_bytes"]
            ids, uploads = [], []
            for d in docs:
                t = time.perf_counter()
                status, body, _ = client.request(
                    "POST", "/v1/contexts", {"text": d.read_text(), "name": d.name}
                )
                if status not in (200, 201):
                    raise RuntimeError(f"upload failed: {status} {body}")
                uploads.append(
                    {
                        "name": d.name,
                        "tokens": body["n_tokens"],
                        "seconds": round(time.perf_counter() - t, 3),
                        "status": status,
                    }
                )
                ids.append(body["id"])
            result["uploads"] = uploads
            # one untimed request: first calls allocate and pick kernels
            client.stream_chat(
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "contexts": ids[:1]}
            )
            rss_before = client.health()["rss_bytes"]
            print(
                f"== load: {args.requests} requests, {args.clients} clients, queue {args.max_queue}",
                flush=True,
            )
            counter = iter(range(args.requests))
            lock = threading.Lock()
            records: list[dict] = []
            deadline = time.monotonic() + args.deadline

            def worker() -> None:
                while time.monotonic() < deadline:
                    with lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    body = {
                        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                        "max_tokens": args.max_tokens,
                        "contexts": [ids[i % len(ids)]],
                    }
                    rec = {"i": i, "rejected_429": 0}
                    for _ in range(200):  # bounded retries after an intended 429
                        try:
                            r = client.stream_chat(body)
                        except OSError as err:
                            r = {"status": None, "error": f"{type(err).__name__}: {err}"}
                        if r["status"] == 429:
                            rec["rejected_429"] += 1
                            time.sleep(0.2)
                            continue
                        rec.update(r)
                        break
                    with lock:
                        records.append(rec)

            t_load = time.perf_counter()
            threads = [threading.Thread(target=worker) for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(args.deadline + 600)
            wall = time.perf_counter() - t_load
            ok = [
                r for r in records if r.get("status") == 200 and r.get("done") and r.get("ttft_s") is not None
            ]
            errors = [r for r in records if r not in ok]
            rss_after = client.health()["rss_bytes"]
            ttft = [r["ttft_s"] for r in ok]
            total = [r["total_s"] for r in ok]
            result["load"] = {
                "requests": args.requests,
                "completed": len(ok),
                "errors": len(errors),
                "error_samples": [{k: e.get(k) for k in ("status", "error")} for e in errors[:5]],
                "rejected_429": sum(r["rejected_429"] for r in records),
                "wall_s": round(wall, 3),
                "requests_per_s": round(len(ok) / wall, 4),
                "ttft_p50_s": pct(ttft, 0.5),
                "ttft_p95_s": pct(ttft, 0.95),
                "total_p50_s": pct(total, 0.5),
                "total_p95_s": pct(total, 0.95),
                "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
                "context_tokens_per_request": sorted(
                    {r["cepe"]["context_tokens"] for r in ok if r.get("cepe")}
                ),
                "rss_before_bytes": rss_before,
                "rss_after_bytes": rss_after,
            }
            print(json.dumps(result["load"], indent=1), flush=True)

            print("== fault: client disconnects mid-stream", flush=True)
            before = client.health()["queue"]["stopped"].get("client gone", 0)
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            body = {
                "messages": [{"role": "user", "content": QUESTIONS[0]}],
                "max_tokens": 256,
                "contexts": ids[:1],
                "stream": True,
            }
            c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            got_token = False
            for _ in range(1000):
                line = r.readline()
                if line.startswith(b"data: ") and b'"content"' in line:
                    got_token = True
                    break
            t = time.perf_counter()
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
            idle_s = None
            for _ in range(3000):
                h = client.health()
                if h["queue"]["running"] == 0 and h["queue"]["waiting"] == 0:
                    idle_s = time.perf_counter() - t
                    break
                time.sleep(0.02)
            h = client.health()
            follow = client.stream_chat({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            result["fault_disconnect"] = {
                "got_first_token": got_token,
                "idle_after_disconnect_s": idle_s,
                "generation_stopped": h["queue"]["stopped"].get("client gone", 0) == before + 1,
                "next_request_ok": follow["status"] == 200 and follow["done"],
            }
            print(json.dumps(result["fault_disconnect"]), flush=True)

            print("== fault: corrupted store file", flush=True)
            status, body, _ = client.request(
                "POST", "/v1/contexts", {"text": "A document to damage. " * 50, "name": "damaged"}
            )
            cid = body["id"]
            f = store / "contexts" / f"{cid}.safetensors"
            data = bytearray(f.read_bytes())
            data[-64] ^= 0xFF
            f.write_bytes(bytes(data))
            status, body, _ = client.request(
                "POST",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "contexts": [cid]},
            )
            result["fault_corrupt"] = {
                "status": status,
                "message": body["error"]["message"]
                if isinstance(body, dict) and "error" in body
                else str(body)[:200],
                "server_ok_after": client.health()["status"] == "ok",
                "removed": client.request("DELETE", f"/v1/contexts/{cid}")[0] == 200,
            }
            print(json.dumps(result["fault_corrupt"]), flush=True)

            print("== graceful shutdown with a stream in flight", flush=True)
            holder: list = []
            t_in = threading.Thread(
                target=lambda: holder.append(
                    client.stream_chat(
                        {
                            "messages": [{"role": "user", "content": QUESTIONS[1]}],
                            "max_tokens": 32,
                            "contexts": ids[:1],
                        }
                    )
                )
            )
            t_in.start()
            for _ in range(2000):
                if client.health()["queue"]["running"]:
                    break
                time.sleep(0.01)
            t = time.perf_counter()
            server.send_signal(signal.SIGTERM)
            t_in.join(300)
            server.wait(120)
            result["shutdown"] = {
                "in_flight_completed": bool(holder and holder[0].get("done")),
                "in_flight_tokens": holder[0].get("pieces") if holder else None,
                "exit_s": round(time.perf_counter() - t, 2),
                "returncode": server.returncode,
            }
            print(json.dumps(result["shutdown"]), flush=True)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(30)
            log.close()
    out = REPO / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_load.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "serve_load.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(r: dict) -> str:
    ld, c = r["load"], r["config"]
    docs = ", ".join(f"{u['name']} {u['tokens']} tokens" for u in r["uploads"])
    mib = 2**20
    lines = [
        "# cepe serve: bounded load run on loopback",
        "",
        f"Model `{c['model']}`, {c['threads']} torch thread(s), queue {c['max_queue']}; {c['clients']} concurrent "
        f"clients, {c['requests']} streaming chat requests of {c['max_tokens']} new tokens, each over one stored "
        f"context ({docs}).",
        "",
        "| requests/s | TTFT p50 | TTFT p95 | total p50 | total p95 | errors | 429s (intended) | RSS before | RSS after |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {ld['requests_per_s']:.3f} | {ld['ttft_p50_s']:.2f} s | {ld['ttft_p95_s']:.2f} s | {ld['total_p50_s']:.2f} s | "
        f"{ld['total_p95_s']:.2f} s | {ld['errors']} | {ld['rejected_429']} | {ld['rss_before_bytes'] / mib:.0f} MiB | "
        f"{ld['rss_after_bytes'] / mib:.0f} MiB |",
        "",
        "Fault runs:",
        "",
    ]
    for run in r["fault_killed_add"]["runs"]:
        lines.append(
            f"- killed `context add` ({run['when']}): "
            + ", ".join(f"{k} {v}" for k, v in run.items() if k != "when")
        )
    d = r["fault_disconnect"]
    lines.append(
        f"- client disconnect mid-stream: generation stopped {d['generation_stopped']}, server idle "
        f"{d['idle_after_disconnect_s']:.2f} s after the disconnect, next request ok {d['next_request_ok']}"
    )
    f = r["fault_corrupt"]
    lines.append(
        f'- corrupted store file: HTTP {f["status"]} "{f["message"]}"; server ok after {f["server_ok_after"]}'
    )
    s = r["shutdown"]
    lines.append(
        f"- SIGTERM with a stream in flight: stream completed {s['in_flight_completed']}, exit after {s['exit_s']} s "
        f"(return code {s['returncode']})"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
