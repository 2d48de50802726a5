"""``cepe serve``: the real server process on a loopback port, driven over HTTP (stdlib client and the
official ``openai`` client). Every loop is bounded; every server started here is stopped here."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cepe.cli import main as cli_main
from cepe.store import context_id

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("bm25s")

REPO = Path(__file__).resolve().parents[1]
DOC = "Paris is the capital of France. The Seine flows through Paris. " * 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``cepe serve --model tiny`` child process on 127.0.0.1."""

    def __init__(self, store: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "cepe.cli", "serve", "--model", "tiny", "--store", str(store)]
        cmd += ["--port", str(self.port), "--threads", "1", *extra]
        penv = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        self.log = open(store.parent / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=penv, cwd=REPO)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            with contextlib.suppress(OSError):
                if self.request("GET", "/health")[0] == 200:
                    return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not start: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def conn(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 60):
        """``(status, parsed JSON or text, headers)``; dict bodies are sent as JSON."""
        headers = dict(headers or {})
        if isinstance(body, dict | list):
            body = json.dumps(body)
            headers.setdefault("Content-Type", "application/json")
        c = self.conn(timeout)
        try:
            c.request(method, path, body=body, headers=headers)
            r = c.getresponse()
            data = r.read().decode("utf-8", "replace")
            with contextlib.suppress(json.JSONDecodeError):
                data = json.loads(data)
            return r.status, data, dict(r.getheaders())
        finally:
            c.close()

    def health(self) -> dict:
        return self.request("GET", "/health")[1]

    def wait_idle(self, seconds: float = 30) -> dict:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            h = self.health()
            if h["queue"]["running"] == 0 and h["queue"]["waiting"] == 0:
                return h
            time.sleep(0.1)
        raise AssertionError(f"server still busy after {seconds}s: {h}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def sse_events(resp) -> list:
    """Parse a server-sent-event body into JSON payloads (``"[DONE]"`` kept as the string)."""
    out = []
    for line in resp.read().decode().splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat(contexts=(), stream=False, max_tokens=6, content="Where is Paris?", **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "contexts": list(contexts),
        **extra,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "doc.txt").write_text(DOC)
    assert (
        cli_main(["context", "add", str(root / "doc.txt"), "--store", str(root / "store"), "--model", "tiny"])
        == 0
    )
    srv = Server(
        root / "store",
        "--max-queue",
        "1",
        "--max-upload-bytes",
        "4096",
        "--max-new-tokens",
        "400",
        "--max-prompt-tokens",
        "1000",
    )
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.output()


@pytest.mark.multiproc
def test_contexts_crud(server):
    status, body, _ = server.request("GET", "/v1/contexts")
    assert status == 200 and [c["id"] for c in body["data"]] == [context_id(DOC)]
    text = "Berlin is the capital of Germany."
    status, body, _ = server.request("POST", "/v1/contexts", text, {"Content-Type": "text/plain"})
    assert (
        status == 201 and body["id"] == context_id(text) and body["added"] and body["n_tokens"] == len(text)
    )
    status, body, _ = server.request("POST", "/v1/contexts", {"text": text, "name": "berlin"})
    assert status == 200 and not body["added"]  # same text: stored once
    assert server.request("GET", f"/v1/contexts/{context_id(text)}")[1]["n_tokens"] == len(text)
    assert server.request("DELETE", f"/v1/contexts/{context_id(text)}")[0] == 200
    assert server.request("GET", f"/v1/contexts/{context_id(text)}")[0] == 404


@pytest.mark.multiproc
def test_chat_stream_equals_non_stream(server):
    cid = context_id(DOC)
    status, body, _ = server.request("POST", "/v1/chat/completions", chat([cid]))
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    assert body["cepe"]["contexts"] == [cid] and not body["cepe"]["retrieved"]
    c = server.conn()
    c.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(chat([cid], stream=True)),
        {"Content-Type": "application/json"},
    )
    r = c.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = sse_events(r)
    c.close()
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant"}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert streamed == answer  # greedy: the streamed tokens are the non-streamed answer
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["cepe"]["contexts"] == [cid]
    # without the context the (context-sensitive) model answers differently
    assert (
        server.request("POST", "/v1/chat/completions", chat())[1]["choices"][0]["message"]["content"]
        != answer
    )


@pytest.mark.multiproc
def test_over_budget_reports_chunks_used(server):
    cid = context_id(DOC)
    body = server.request("POST", "/v1/chat/completions", chat([cid], context_budget=32, content="Seine"))[1]
    info = body["cepe"]
    assert info["retrieved"] and info["retriever"] == "bm25" and info["context_tokens"] == 32
    assert sum(b - a for a, b in info["chunks_used"][cid]) == 2


@pytest.mark.multiproc
def test_openai_client_unchanged(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    cid = context_id(DOC)
    ref = server.request("POST", "/v1/chat/completions", chat([cid]))[1]["choices"][0]["message"]["content"]
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Where is Paris?"}],
        max_tokens=6,
        extra_body={"contexts": [cid]},
    )
    assert r.choices[0].message.content == ref and r.usage.completion_tokens == 6
    assert r.model_extra["cepe"]["contexts"] == [cid]  # the extension field reaches the client
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Where is Paris?"}],
        max_tokens=6,
        stream=True,
        extra_body={"contexts": [cid]},
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == ref
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
    texts = list(
        client.completions.create(
            model="tiny", prompt="Paris is", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert texts[-1].usage.completion_tokens == 3 and texts[-1].object == "text_completion"
    sampled = [
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=1.0, seed=s
        )
        .choices[0]
        .message.content
        for s in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1] != sampled[2]  # sampling is seeded per request
    comp = client.completions.create(model="tiny", prompt="Paris is", max_tokens=5)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 5
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(model="tiny", prompt="Paris is", max_tokens=5, stream=True)
    )
    assert streamed == comp.choices[0].text
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError, match="unknown context id"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], extra_body={"contexts": ["f" * 16]}
        )


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "message"),
    [
        (
            "POST",
            "/v1/chat/completions",
            '{"messages": [',
            {"Content-Type": "application/json"},
            400,
            "malformed JSON",
        ),
        ("POST", "/v1/chat/completions", chat(max_tokens="six"), None, 400, "max_tokens"),
        ("POST", "/v1/chat/completions", {"messages": "hi"}, None, 400, "messages"),
        ("POST", "/v1/chat/completions", chat(max_tokens=401), None, 400, "exceeds this server's limit"),
        ("POST", "/v1/chat/completions", chat(contexts=["../../etc/passwd"]), None, 400, "not a context id"),
        ("POST", "/v1/chat/completions", chat(contexts=["0" * 16]), None, 404, "unknown context id"),
        (
            "POST",
            "/v1/chat/completions",
            chat(content="x" * 2000),  # 2000 byte tokens > --max-prompt-tokens 1000, body < 4096 bytes
            None,
            400,
            "more than this server's limit",
        ),
        ("POST", "/v1/completions", {"prompt": 5}, None, 400, "prompt"),
        ("POST", "/v1/chat/completions", chat(temperature=1.0, seed=2**64), None, 400, "seed"),
        ("POST", "/v1/contexts", b"\xff\xfeabc", {"Content-Type": "text/plain"}, 400, "not UTF-8"),
        ("POST", "/v1/contexts", "x" * 5000, {"Content-Type": "text/plain"}, 413, "exceeds the limit"),
        ("POST", "/v1/contexts", '{"text": 3}', {"Content-Type": "application/json"}, 400, '"text" string'),
        (
            "POST",
            "/v1/contexts",
            '{"text": "\\ud800"}',
            {"Content-Type": "application/json"},
            400,
            "not valid Unicode",
        ),
        ("POST", "/v1/contexts", "   ", {"Content-Type": "text/plain"}, 400, "empty"),
        ("GET", "/v1/contexts/..%2F..%2Fetc%2Fpasswd", None, None, 404, ""),
        ("GET", "/v1/contexts/store.json", None, None, 404, "not a context id"),
        ("DELETE", "/v1/contexts/" + "0" * 16, None, None, 404, "no context"),
    ],
)
@pytest.mark.multiproc
def test_bad_input_gets_a_4xx_with_a_message(server, method, path, body, headers, status, message):
    got, data, _ = server.request(method, path, body, headers)
    assert got == status, data
    assert isinstance(data, dict) and message in data["error"]["message"]
    assert server.health()["status"] == "ok"


@pytest.mark.multiproc
def test_oversize_body_on_any_route_is_refused(server):
    big = json.dumps(chat(content="x" * 5000))  # over the server's 4096-byte body limit
    status, data, _ = server.request(
        "POST", "/v1/chat/completions", big, {"Content-Type": "application/json"}
    )
    assert status == 413 and "exceeds the limit" in data["error"]["message"]
    c = server.conn()
    c.putrequest("POST", "/v1/chat/completions")
    c.putheader("Content-Type", "application/json")
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    with contextlib.suppress(OSError):
        for _ in range(10):
            c.send(b"400\r\n" + b" " * 1024 + b"\r\n")
        c.send(b"0\r\n\r\n")
    r = c.getresponse()
    assert r.status == 413 and "exceeds the limit" in r.read().decode()
    c.close()
    assert server.health()["status"] == "ok"


@pytest.mark.multiproc
def test_chunked_oversize_upload_is_refused(server):
    c = server.conn()
    c.putrequest("POST", "/v1/contexts")
    c.putheader("Content-Type", "text/plain")
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    with contextlib.suppress(OSError):
        for _ in range(10):  # no Content-Length: the limit is enforced while reading
            c.send(b"400\r\n" + b"y" * 1024 + b"\r\n")
        c.send(b"0\r\n\r\n")
    r = c.getresponse()
    assert r.status == 413 and "exceeds the limit" in r.read().decode()
    c.close()


@pytest.mark.multiproc
def test_full_queue_gets_429_and_nothing_else_fails(server):
    server.wait_idle()
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        status, _, headers = server.request("POST", "/v1/chat/completions", chat(max_tokens=150), timeout=120)
        with lock:
            results.append((status, headers.get("retry-after")))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    statuses = sorted(s for s, _ in results)
    assert len(statuses) == 5 and set(statuses) <= {200, 429}, results
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1  # one running + one waiting fit
    assert all(ra == "1" for s, ra in results if s == 429)
    assert server.health()["queue"]["rejected_429"] >= 1


@pytest.mark.multiproc
def test_client_disconnect_mid_stream_stops_generation(server):
    server.wait_idle()
    before = server.health()["queue"]["stopped"].get("client gone", 0)
    c = server.conn()
    c.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(chat(stream=True, max_tokens=400)),
        {"Content-Type": "application/json"},
    )
    r = c.getresponse()
    assert r.status == 200
    first = r.readline()
    assert first.startswith(b"data: ")
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    h = server.wait_idle(60)
    assert h["queue"]["stopped"].get("client gone", 0) == before + 1
    status, body, _ = server.request("POST", "/v1/chat/completions", chat())
    assert status == 200 and body["usage"]["completion_tokens"] == 6


@pytest.mark.multiproc
def test_client_that_leaves_a_whole_answer_stops_its_generation(server):
    """Not streamed: the server does not cancel the handler of a client that left, so the handler's own
    check stops the generation (before, it ran to max_tokens for nobody)."""
    server.wait_idle()
    before = server.health()["queue"]["stopped"].get("client gone", 0)
    c = server.conn()
    c.request(
        "POST", "/v1/chat/completions", json.dumps(chat(max_tokens=400)), {"Content-Type": "application/json"}
    )
    deadline = time.monotonic() + 30
    while server.health()["queue"]["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    h = server.wait_idle(60)
    assert h["queue"]["stopped"].get("client gone", 0) == before + 1


@pytest.mark.multiproc
def test_corrupted_store_file_is_refused_and_server_lives(server, tmp_path):
    text = "A document that will be damaged on disk."
    status, body, _ = server.request("POST", "/v1/contexts", text, {"Content-Type": "text/plain"})
    cid = body["id"]
    f = Path(server.log.name).parent / "store" / "contexts" / f"{cid}.safetensors"
    data = bytearray(f.read_bytes())
    data[-20] ^= 0xFF
    f.write_bytes(bytes(data))
    status, body, _ = server.request("POST", "/v1/chat/completions", chat([cid]))
    assert status == 500 and "corrupted" in body["error"]["message"]
    assert server.request("DELETE", f"/v1/contexts/{cid}")[0] == 200
    assert server.health()["status"] == "ok"


@pytest.mark.multiproc
def test_token_graceful_shutdown_and_host_guard(tmp_path, capsys):
    rc = cli_main(["serve", "--model", "tiny", "--store", str(tmp_path / "s"), "--host", "0.0.0.0"])
    assert rc == 2 and "CEPE_API_KEY" in capsys.readouterr().err  # refused before loading anything
    srv = Server(tmp_path / "s", "--max-queue", "2", "--shutdown-grace", "20", env={"CEPE_API_KEY": "sesame"})
    try:
        assert srv.request("GET", "/v1/contexts")[0] == 401
        assert srv.request("GET", "/v1/contexts", headers={"Authorization": "Bearer wrong"})[0] == 401
        auth = {"Authorization": "Bearer sesame", "Content-Type": "application/json"}
        assert srv.request("GET", "/v1/contexts", headers=auth)[0] == 200
        # one long stream in flight and one waiting, then SIGTERM
        c1 = srv.conn()
        c1.request("POST", "/v1/chat/completions", json.dumps(chat(stream=True, max_tokens=300)), auth)
        r1 = c1.getresponse()
        assert r1.status == 200 and r1.readline().startswith(b"data: ")
        waiting: list = []
        t = threading.Thread(
            target=lambda: waiting.append(
                srv.request("POST", "/v1/chat/completions", chat(max_tokens=5), auth)
            )
        )
        t.start()
        deadline = time.monotonic() + 20
        while srv.health()["queue"]["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        events = sse_events(r1)  # the running request finishes
        c1.close()
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["cepe"]["stopped"] is None  # finished, not cut off
        assert sum(len(e["choices"][0]["delta"].get("content", "")) > 0 for e in events[:-1]) > 10
        t.join(60)
        assert waiting and waiting[0][0] == 503 and "shutting down" in waiting[0][1]["error"]["message"]
        srv.proc.wait(60)
        with pytest.raises(OSError):
            srv.request("GET", "/health", timeout=5)
    finally:
        srv.stop()


def _run_in_process(model, tok, tmp_path, limits, max_new_tokens: int) -> tuple[dict, dict]:
    """Run one generation job through the service without HTTP: ``(end info, worker state)``."""
    import asyncio

    from cepe.server import CepeService
    from cepe.store import ContextStore

    service = CepeService(model, tok, ContextStore(tmp_path / "s", model, tok), limits, "tiny")
    spec = {
        "prompt_ids": tok.encode("Hello"),
        "query": "Hello",
        "contexts": [],
        "budget": None,
        "retriever": "bm25",
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
    }

    async def go():
        job = service.make_job(asyncio.get_running_loop(), spec)
        service.worker.submit(job)
        return await asyncio.wait_for(job.done, 120)

    try:
        return asyncio.run(go()), service.worker.state()
    finally:
        service.worker.stop()


def test_request_time_limit_stops_generation(tmp_path):
    """In-process: a request past its time limit stops at the next token and says so."""
    from cepe.server import ServeLimits
    from cepe.tiny import tiny_model

    model, tok = tiny_model()
    info, state = _run_in_process(model, tok, tmp_path, ServeLimits(request_timeout_s=0.3), 3000)
    assert info["timed_out"] and info["stopped"] == "timeout"
    assert 0 < info["completion_tokens"] < 3000 and info["finish_reason"] == "length"
    assert state["stopped"] == {"timeout": 1}


def test_end_of_sequence_finishes_with_stop(tmp_path):
    from cepe.server import ServeLimits
    from cepe.tiny import tiny_model

    model, tok = tiny_model()
    ids = torch.tensor([tok.encode("Hello")])
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    eos = greedy[2]
    model.decoder.generation_config.eos_token_id = eos
    info, _ = _run_in_process(model, tok, tmp_path, ServeLimits(), 8)
    assert info["finish_reason"] == "stop" and info["completion_tokens"] == greedy.index(eos) + 1
    info, _ = _run_in_process(model, tok, tmp_path / "b", ServeLimits(), greedy.index(eos))
    assert info["finish_reason"] == "length"
    # the end-of-sequence as the last allowed token is still the model's stop (was "length")
    info, _ = _run_in_process(model, tok, tmp_path / "c", ServeLimits(), greedy.index(eos) + 1)
    assert info["finish_reason"] == "stop" and info["completion_tokens"] == greedy.index(eos) + 1


def test_chat_template_refusal_is_a_400(tmp_path):
    """A chat template that refuses the conversation (``raise_exception``, e.g. no system role) is the
    client's error, with the template's message, not a 500."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cepe.server import CepeService, ServeLimits, ServiceError, _completion_spec
    from cepe.store import ContextStore
    from cepe.tiny import tiny_model

    model, _ = tiny_model()
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "<eos>": 1, "Hi": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="[UNK]")
    tok.chat_template = (  # as Gemma's refuses a system turn
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }} {% endfor %}"
    )
    service = CepeService(model, tok, ContextStore(tmp_path / "s", model, tok), ServeLimits(), "tiny")
    try:
        req = SimpleNamespace(
            max_completion_tokens=None,
            max_tokens=4,
            contexts=[],
            context_budget=None,
            retriever="bm25",
            temperature=None,
            top_p=1.0,
            seed=None,
        )
        with pytest.raises(
            ServiceError, match="chat template does not accept these messages: System role"
        ) as err:
            _completion_spec(service, req, [{"role": "system", "content": "Be brief."}], None)
        assert err.value.status == 400
        spec = _completion_spec(service, req, [{"role": "user", "content": "Hi"}], None)
        assert spec["prompt_ids"] == [2]
    finally:
        service.worker.stop()


async def _asgi_call(app, method: str, path: str, body=None, headers=None) -> tuple[int, object]:
    """One request to ``app`` in-process through its ASGI interface (no socket): ``(status, parsed JSON
    or text)``; dict bodies are sent as JSON."""
    import asyncio

    headers = dict(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body)
        headers.setdefault("content-type", "application/json")
    data = body.encode() if isinstance(body, str) else body or b""
    sent, finished, out = False, asyncio.Event(), {"status": None, "body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")
            if not msg.get("more_body"):
                finished.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [(b"content-length", str(len(data)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 120)
    text = out["body"].decode("utf-8", "replace")
    with contextlib.suppress(json.JSONDecodeError):
        return out["status"], json.loads(text)
    return out["status"], text


def _asgi(app, method: str, path: str, body=None, headers=None) -> tuple[int, object]:
    """:func:`_asgi_call` on a loop of its own (the request's jobs must be done when it returns)."""
    import asyncio

    return asyncio.run(_asgi_call(app, method, path, body, headers))


@pytest.fixture
def app_service(tmp_path):
    """``(app, service)`` over the tiny model, in-process; factory of further ones with other limits."""
    from cepe.server import CepeService, ServeLimits, create_app
    from cepe.store import ContextStore
    from cepe.tiny import tiny_model

    services = []

    def make(limits=None, model_and_tok=None):
        model, tok = model_and_tok or tiny_model()
        root = tmp_path / f"s{len(services)}"
        service = CepeService(model, tok, ContextStore(root, model, tok), limits or ServeLimits(), "tiny")
        services.append(service)
        return create_app(service), service

    yield make
    for service in services:
        service.worker.stop()


def test_upload_name_that_is_not_unicode_is_a_400_before_encoding(app_service):
    """A lone surrogate in ``"name"`` passed, was encoded, then failed in ``save_file``: a 500."""
    app, service = app_service()
    status, body = _asgi(app, "POST", "/v1/contexts", {"text": "hello there", "name": "\ud800"})
    assert status == 400 and '"name" is not valid Unicode' in body["error"]["message"], body
    assert service.worker.state()["served"] == 0 and service.store.ids() == []  # the model never ran
    status, body = _asgi(app, "POST", "/v1/contexts", {"text": "hello there", "name": "ok"})
    assert status == 201 and body["name"] == "ok"


def test_a_queued_request_is_answered_at_its_time_limit(app_service):
    """The time limit counts the wait in the queue, but was only looked at when the worker took the job:
    behind a long job (an upload's encode, a long prefill) a queued request waited for it whatever its
    limit. Now it is answered 503 at its deadline while the worker is still busy, and never runs."""
    import asyncio

    from cepe.server import Job, ServeLimits

    app, service = app_service(ServeLimits(request_timeout_s=0.3))
    release, finished = threading.Event(), threading.Event()

    def busy(job: Job) -> None:
        release.wait(60)
        finished.set()

    async def go():
        service.worker.submit(Job(asyncio.get_running_loop(), busy, time.monotonic() + 120))
        status, body = await _asgi_call(app, "POST", "/v1/chat/completions", chat(max_tokens=2))
        answered_while_busy = not finished.is_set()
        upload = await _asgi_call(app, "POST", "/v1/contexts", "A document.", {"content-type": "text/plain"})
        answered_while_busy &= not finished.is_set()
        release.set()
        deadline = time.monotonic() + 60
        while service.worker.state()["served"] < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the worker resolves the jobs on this loop: it must run
        return answered_while_busy, status, body, upload

    try:
        answered_while_busy, status, body, upload = asyncio.run(go())
    finally:
        release.set()
    assert answered_while_busy and status == 503, body
    assert body["error"]["message"] == "gave up waiting for the model (timeout)"
    assert upload[0] == 503 and "(timeout)" in upload[1]["error"]["message"]
    assert service.worker.state()["stopped"] == {"timeout": 2} and service.store.ids() == []


def test_tiny_temperature_and_null_defaults(app_service):
    """A tiny positive temperature overflowed the logits (inf / NaN): a 500 from ``torch.multinomial``;
    now it decodes greedily, as 0 does. ``null`` for ``stream`` / ``top_p`` / ``n`` (nullable in OpenAI's
    API) was a 400; now it is the default."""
    app, _ = app_service()
    status, greedy = _asgi(app, "POST", "/v1/chat/completions", chat(max_tokens=4, temperature=0.0))
    assert status == 200, greedy
    status, body = _asgi(app, "POST", "/v1/chat/completions", chat(max_tokens=4, temperature=1e-300))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    status, body = _asgi(
        app, "POST", "/v1/chat/completions", chat(max_tokens=4, stream=None, top_p=None, n=None)
    )
    assert status == 200 and body["object"] == "chat.completion", body
    assert body["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    status, body = _asgi(
        app,
        "POST",
        "/v1/completions",
        {"prompt": "Paris is", "max_tokens": 2, "top_p": None, "temperature": 1.0},
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    status, body = _asgi(app, "POST", "/v1/chat/completions", chat(n=2))
    assert status == 400 and "n" in body["error"]["message"]  # still only one choice


def test_tokenizing_a_prompt_does_not_hold_up_the_event_loop(app_service):
    """The chat template and the tokenizer ran on the event loop: a prompt of a few MiB (or a tokenizer
    busy on the model thread) froze every client for seconds. Now they run in a thread: ``/health``
    answers while a prompt is still being tokenized."""
    import asyncio

    from cepe.tiny import ByteTokenizer, tiny_model

    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    class SlowTokenizer(ByteTokenizer):
        def __call__(self, texts, add_special_tokens=False):
            if texts == "a slow prompt":
                entered.set()
                release.wait(30)
                left.set()
            return super().__call__(texts, add_special_tokens=add_special_tokens)

    model, _ = tiny_model()
    app, _ = app_service(model_and_tok=(model, SlowTokenizer()))

    async def go():
        body = {"prompt": "a slow prompt", "max_tokens": 2}
        slow = asyncio.create_task(_asgi_call(app, "POST", "/v1/completions", body))
        deadline = time.monotonic() + 60
        while not entered.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        health = await _asgi_call(app, "GET", "/health")
        answered_meanwhile = entered.is_set() and not left.is_set()
        release.set()
        return answered_meanwhile, health, await slow

    try:
        answered_meanwhile, health, (status, body) = asyncio.run(go())
    finally:
        release.set()
    assert answered_meanwhile and health[0] == 200
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_answers_are_decoded_without_the_model_threads_tokenizer_lock(tmp_path):
    """The event loop decodes the answers' text with its own copy of the tokenizer: a decode finishes while
    another thread holds the shared tokenizer's lock (the model thread tokenizing a large upload)."""
    import threading

    from cepe.server import CepeService, ServeLimits, TextDelta
    from cepe.store import ContextStore
    from cepe.tiny import tiny_model

    model, tok = tiny_model()
    service = CepeService(model, tok, ContextStore(tmp_path / "s", model, tok), ServeLimits(), "tiny")
    try:
        held, release = threading.Event(), threading.Event()

        def hold() -> None:  # the model thread, busy in the shared tokenizer
            with service.tokenizer._lock:
                held.set()
                release.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(10)
        out: list[str] = []
        decoder = threading.Thread(
            target=lambda: out.append(TextDelta(service.detokenizer).push(tok.encode("hi")))
        )
        decoder.start()
        decoder.join(10)
        finished = not decoder.is_alive()
        release.set()
        holder.join()
        decoder.join()
        assert finished and out == ["hi"]
        assert service.detokenizer is not tok and not isinstance(service.detokenizer, type(service.tokenizer))
    finally:
        service.worker.stop()
