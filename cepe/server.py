"""``cepe serve``: an OpenAI-compatible HTTP server over one CEPE model and a context store.

Built on FastAPI (request parsing and type checking by pydantic, routing, server-sent events through
Starlette's streaming responses) served by uvicorn (HTTP/1.1 with h11, graceful shutdown on SIGTERM /
SIGINT); both are widely used and maintained, and no HTTP is parsed or written by hand here.

Endpoints:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI request / response shapes, token
  streaming as server-sent events (``"stream": true``). Extension fields: ``contexts`` (stored context
  ids to attend to), ``context_budget`` (attend to at most this many context tokens; beyond it the
  chunks most relevant to the question are selected by ``retriever``, ``"bm25"`` or ``"dense"``). The
  answer's ``cepe`` field says which chunks were used.
- ``POST /v1/contexts`` (text body, or JSON ``{"text": ..., "name": ...}``) encodes and stores a
  document and returns its id; ``GET /v1/contexts``, ``GET`` and ``DELETE /v1/contexts/{id}``.
- ``GET /v1/models``, ``GET /health`` (queue state and resident memory).

One model serves one request at a time on a worker thread. Requests wait in a bounded queue: when it is
full a request gets 429 (with ``Retry-After``); during shutdown 503. Per-request limits: prompt tokens,
new tokens, upload bytes, and a time limit (waiting included): a request still queued at it gets 503
then (it never runs); a running one stops generating (the answer ends with ``finish_reason: "length"`` and
``cepe.timed_out: true``). A ``temperature`` under :data:`GREEDY_BELOW` decodes greedily as 0 does;
``null`` for ``stream``, ``top_p`` or ``n`` is the default, as in OpenAI's API. A client that disconnects
mid-stream stops its generation at the next token. On SIGTERM / SIGINT the server stops accepting,
fails queued requests with 503, lets the running one finish within ``shutdown_grace_s`` (then stops it)
and exits. It listens on 127.0.0.1 unless told otherwise; bound elsewhere it requires a bearer token
(``CEPE_API_KEY``) unless started with ``--no-auth``. Context ids are validated (16 hex digits), so no
request can name a path on disk.
"""

# No `from __future__ import annotations`: FastAPI reads the request models from the annotations of
# handlers defined inside create_app, which must therefore be real objects, not strings.
import asyncio
import copy
import hmac
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import torch

from .serve_config import LOOPBACK, ServeLimits
from .store import ContextNotFound, ContextStore, CorruptContext, StoreError, check_id, prompt_ids


class ServiceError(Exception):
    """An error with an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers or {}


def resident_bytes() -> int:
    """Resident set size of this process in bytes (``/proc/self/statm``; peak RSS where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ---------------------------------------------------------------------------------------- the worker
def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class LockedTokenizer:
    """A tokenizer shared by the event loop and the model thread: one call at a time."""

    def __init__(self, tokenizer) -> None:
        self._tok, self._lock = tokenizer, threading.RLock()
        self.wrapped_tokenizer = tokenizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tok(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._tok, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return locked


class Job:
    """One unit of model work, run on the worker thread.

    ``prepare()`` (load contexts, check limits) runs first and its outcome resolves ``ready``; then
    ``run(job)`` generates, pushing events (``("token", ids)``, ``("end", info)``) to the request's
    asyncio queue. ``cancel()`` stops generation at the next token.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, run: Callable[["Job"], Any], deadline: float) -> None:
        self.loop, self.run, self.deadline = loop, run, deadline
        self.ready: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.reason: str | None = None
        self.started = False  # taken by the worker (see :meth:`start` and :meth:`expire`)
        self._state = threading.Lock()
        for fut in (self.ready, self.done):
            fut.add_done_callback(_consume)  # an unawaited failure is not a warning: it was reported

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.cancelled.is_set():
            self.reason = reason
            self.cancelled.set()

    def should_stop(self) -> bool:
        if time.monotonic() > self.deadline:
            self.cancel("timeout")
        return self.cancelled.is_set()

    def start(self) -> bool:
        """The worker takes the job: False (and it must not run) when it was stopped while queued."""
        with self._state:
            if self.should_stop():
                return False
            self.started = True
            return True

    def expire(self) -> bool:
        """Cancel a job still queued past its deadline (``"timeout"``): True when it will never run; False
        when the worker has it already (it then stops at its next token, see :func:`_stopping`)."""
        with self._state:
            if self.started:
                return False
            self.cancel("timeout")
            return True

    def _resolve(self, fut: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
        def set_it() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        self.loop.call_soon_threadsafe(set_it)

    def set_ready(self, error: BaseException | None = None) -> None:
        self._resolve(self.ready, True, error)

    def emit(self, kind: str, payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def fail(self, error: BaseException) -> None:
        self._resolve(self.ready, error=error)
        self._resolve(self.done, error=error)
        self.emit("error", error)


class ModelWorker:
    """One thread that runs :class:`Job` s one at a time from a bounded queue."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.RLock()  # re-entrant: the signal handler may interrupt submit()
        self.waiting = 0
        self.running: Job | None = None
        self.closing = False
        self.served = 0
        self.rejected = 0
        self.stopped: dict[str, int] = {}  # jobs stopped before their end, by reason
        self._thread = threading.Thread(target=self._loop, name="cepe-model", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ``ServiceError`` 429 (queue full) / 503 (shutting down)."""
        with self._lock:
            if self.closing:
                raise ServiceError(503, "the server is shutting down", "server_error")
            if self.waiting >= self.max_queue:
                self.rejected += 1
                raise ServiceError(
                    429,
                    f"the request queue is full ({self.max_queue} waiting); retry later",
                    "rate_limit_error",
                    {"Retry-After": "1"},
                )
            self.waiting += 1
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                if self.closing:
                    job.fail(ServiceError(503, "the server is shutting down", "server_error"))
                    continue
                self.running = job
            value, error = None, None
            try:
                if not job.start():
                    raise ServiceError(503, f"gave up waiting for the model ({job.reason})", "server_error")
                value = job.run(job)
            except BaseException as err:  # every failure is reported to its request; the worker lives on
                error = err if isinstance(err, Exception) else RuntimeError(str(err))
            with self._lock:  # counters first: a caller woken by the result sees them updated
                self.running = None
                self.served += 1
                if job.reason is not None:
                    self.stopped[job.reason] = self.stopped.get(job.reason, 0) + 1
            if error is not None:
                job.fail(error)
            else:
                job._resolve(job.done, value)

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new jobs, fail the queued ones (503), stop the running one after ``grace_s``."""
        with self._lock:
            self.closing = True
            running = self.running
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)
                    break
                self.waiting -= 1
                job.fail(ServiceError(503, "the server is shutting down", "server_error"))
        if running is not None:
            timer = threading.Timer(grace_s, running.cancel, args=("shutdown",))
            timer.daemon = True
            timer.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "waiting": self.waiting,
                "running": int(self.running is not None),
                "capacity": self.max_queue,
                "served": self.served,
                "rejected_429": self.rejected,
                "stopped": dict(self.stopped),
                "closing": self.closing,
            }


# ---------------------------------------------------------------------------------------- generation
class _TokenStream:
    """HF streamer: forwards each generated token to the job (the first ``put`` is the prompt)."""

    def __init__(self, job: Job) -> None:
        self.job, self.seen_prompt, self.ids = job, False, []

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        ids = value.reshape(-1).tolist()
        self.ids += ids
        self.job.emit("token", ids)

    def end(self) -> None:
        pass


def _stopping(job: Job):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return torch.full(
                (input_ids.shape[0],), job.should_stop(), dtype=torch.bool, device=input_ids.device
            )

    return StoppingCriteriaList([_Stop()])


class TextDelta:
    """Incremental detokenization: the text added by new tokens, held back while it ends mid-character."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.ids, self.sent = tokenizer, [], ""

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


# ---------------------------------------------------------------------------------------- the app
class CepeService:
    """The model, tokenizer, store, worker and limits behind the HTTP app."""

    def __init__(self, model, tokenizer, store: ContextStore, limits: ServeLimits, model_name: str) -> None:
        # the event loop's own copy, for the answers' text alone (it runs on the loop's one thread): a
        # decode never waits for the shared tokenizer's lock while the model thread tokenizes an upload
        self.detokenizer = copy.deepcopy(tokenizer)
        tokenizer = LockedTokenizer(tokenizer)
        store.tokenizer = tokenizer
        self.model, self.tokenizer, self.store, self.limits = model, tokenizer, store, limits
        self.model_name = model_name
        self.worker = ModelWorker(limits.max_queue)
        self.started = time.time()

    def health(self) -> dict[str, Any]:
        return {
            "status": "shutting_down" if self.worker.closing else "ok",
            "model": self.model_name,
            "queue": self.worker.state(),
            "contexts": len(self.store.ids()),
            "rss_bytes": resident_bytes(),
            "uptime_s": round(time.time() - self.started, 3),
        }

    def make_job(self, loop, spec: dict[str, Any]) -> Job:
        """A generation job for a validated request ``spec`` (see :func:`create_app`)."""
        deadline = time.monotonic() + self.limits.request_timeout_s

        def run(job: Job) -> dict[str, Any]:
            try:
                ctx = None
                if spec["contexts"]:
                    ctx = self.store.context(
                        spec["contexts"],
                        query=spec["query"],
                        budget_tokens=spec["budget"],
                        retriever=spec["retriever"],
                    )
            except ContextNotFound as err:
                raise ServiceError(404, str(err), "not_found_error") from err
            except CorruptContext as err:
                raise ServiceError(500, str(err), "server_error") from err
            except (StoreError, ValueError, ImportError, FileNotFoundError) as err:
                raise ServiceError(400, str(err)) from err
            job.set_ready()
            input_ids = torch.tensor([spec["prompt_ids"]], device=self.model.device)
            gen: dict[str, Any] = {"do_sample": False}
            if spec["temperature"]:
                gen = {"do_sample": True, "temperature": spec["temperature"], "top_p": spec["top_p"]}
                if spec["seed"] is not None:
                    torch.manual_seed(spec["seed"])
                else:  # not the sequence an earlier request's seed set: unseeded samples stay unpredictable
                    torch.seed()
            streamer = _TokenStream(job)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=spec["max_new_tokens"],
                pad_token_id=getattr(self.tokenizer, "pad_token_id", None) or eos,
                streamer=streamer,
                stopping_criteria=_stopping(job),
                **gen,
                **(ctx.encoder_kwargs() if ctx is not None else {}),
            )
            ids = streamer.ids
            # ended by the model's end-of-sequence (before max_new_tokens, or as the last allowed token)
            # without being stopped
            ended = len(ids) < spec["max_new_tokens"] or bool(ids) and ids[-1] in _eos_ids(self.model)
            finish = "stop" if ended and job.reason is None else "length"
            info = {
                "finish_reason": finish,
                "completion_tokens": len(ids),
                "timed_out": job.reason == "timeout",
                "stopped": job.reason,
                "context": ctx.describe() if ctx is not None else None,
            }
            job.emit("end", info)
            return info

        return Job(loop, run, deadline)


def _eos_ids(model) -> set[int]:
    """The end-of-sequence ids ``model.generate`` stops at (its decoder's generation config)."""
    config = getattr(getattr(model, "decoder", model), "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


GREEDY_BELOW = 1e-4
"""A ``temperature`` under this (but not 0) decodes greedily, as 0 does: dividing the logits by a smaller one
overflows to inf / NaN, and the sample is the most likely token anyway."""


def create_app(service: CepeService, api_key: str | None = None):
    """The FastAPI application over ``service``; ``api_key`` (if set) is required as a bearer token on
    every ``/v1`` route."""
    from fastapi import Depends, FastAPI, Request
    from pydantic import BaseModel, ConfigDict, Field

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)
        role: Literal["system", "user", "assistant", "developer"]
        content: str

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)
        include_usage: bool = False

    class Common(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)
        model: str | None = None
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        # null (as OpenAI's API allows) is the default: stream false, top_p 1, n 1
        stream: bool | None = False
        stream_options: StreamOptions | None = None
        temperature: float | None = Field(None, ge=0.0, le=2.0)
        top_p: float | None = Field(1.0, gt=0.0, le=1.0)
        seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # torch's seed range
        n: int | None = Field(1, ge=1, le=1)
        stop: None = None
        contexts: list[str] = Field(default_factory=list, max_length=64)
        context_budget: int | None = Field(None, ge=1)
        retriever: Literal["bm25", "dense"] = "bm25"

    class ChatRequest(Common):
        messages: list[Message] = Field(min_length=1, max_length=256)

    class CompletionRequest(Common):
        prompt: str

    async def auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ServiceError(
                401, "missing or wrong bearer token (Authorization: Bearer <key>)", "authentication_error"
            )

    app = FastAPI(title="cepe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(BodyLimit, limit=service.limits.max_upload_bytes)
    _add_error_handlers(app)
    guarded = [Depends(auth)]

    @app.get("/health")
    async def health():
        return service.health()

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model_name,
                    "object": "model",
                    "created": int(service.started),
                    "owned_by": "cepe",
                }
            ],
        }

    _add_context_routes(app, service, guarded)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(req: ChatRequest, request: Request):
        messages = [m.model_dump() for m in req.messages]
        # off the event loop: the chat template and the tokenizer over a prompt of up to the body limit
        # take seconds, and may wait for the tokenizer's lock while the model thread tokenizes an upload
        spec = await asyncio.to_thread(_completion_spec, service, req, messages, None)
        return await _complete(service, req, spec, chat=True, request=request)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, request: Request):
        spec = await asyncio.to_thread(_completion_spec, service, req, None, req.prompt)
        return await _complete(service, req, spec, chat=False, request=request)

    return app


def _error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def _add_error_handlers(app) -> None:
    """Every error as an OpenAI-style ``{"error": {"message", "type", "code"}}`` body."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, err: ServiceError):
        return JSONResponse(_error_body(err.status, err.message, err.kind), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        parts = []
        for e in err.errors()[:5]:
            if e.get("type") == "json_invalid":
                parts.append(f"malformed JSON body ({e.get('ctx', {}).get('error', 'JSON decode error')})")
                continue
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            parts.append(f"{loc}: {e.get('msg')}")
        return JSONResponse(
            _error_body(400, "invalid request: " + "; ".join(parts), "invalid_request_error"), 400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(
            _error_body(err.status_code, str(err.detail), "invalid_request_error"), err.status_code
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        return JSONResponse(
            _error_body(500, f"internal error: {type(err).__name__}: {err}", "server_error"), 500
        )


def _add_context_routes(app, service: CepeService, guarded: list[Any]) -> None:
    """``GET /v1/contexts``, ``GET`` / ``DELETE /v1/contexts/{id}`` and ``POST /v1/contexts`` (the
    encoding runs on the model thread, behind the same queue as completions)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    limits = service.limits

    @app.get("/v1/contexts", dependencies=guarded)
    def list_contexts():
        return {"object": "list", "data": [_context_view(r) for r in service.store.list()]}

    @app.get("/v1/contexts/{cid}", dependencies=guarded)
    def get_context(cid: str):
        return _context_view(_store_call(service.store.show, cid))

    @app.delete("/v1/contexts/{cid}", dependencies=guarded)
    def delete_context(cid: str):
        _store_call(service.store.remove, cid)
        return {"id": cid, "object": "context", "deleted": True}

    @app.post("/v1/contexts", dependencies=guarded)
    async def add_context(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_upload_bytes:
            raise ServiceError(
                413, f"upload of {length} bytes exceeds the limit of {limits.max_upload_bytes} bytes"
            )
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limits.max_upload_bytes:
                raise ServiceError(413, f"upload exceeds the limit of {limits.max_upload_bytes} bytes")
        text, name = _parse_upload(bytes(body), request.headers.get("content-type", ""))
        loop = asyncio.get_running_loop()

        def run(job: Job) -> tuple[str, bool]:
            job.set_ready()
            try:
                return service.store.add_text(text, name=name)
            except StoreError as err:
                raise ServiceError(400, str(err)) from err

        job = Job(loop, run, time.monotonic() + limits.request_timeout_s)
        service.worker.submit(job)
        cid, added = await _until(job.done, job, request)  # queued past the time limit, or the client left
        view = _context_view(_store_call(service.store.show, cid))  # a DELETE may have come in between
        return JSONResponse({**view, "added": added}, status_code=201 if added else 200)


def _completion_spec(
    service: CepeService, req: Any, messages: list[dict[str, str]] | None, prompt: str | None
) -> dict[str, Any]:
    """The generation job of a (chat) completion request, checked against the limits and the store."""
    limits = service.limits
    max_new = req.max_completion_tokens or req.max_tokens or limits.default_new_tokens
    if max_new > limits.max_new_tokens:
        raise ServiceError(
            400, f"max_tokens {max_new} exceeds this server's limit of {limits.max_new_tokens}"
        )
    for cid in req.contexts:
        try:
            check_id(cid)
        except ContextNotFound as err:
            raise ServiceError(400, str(err)) from err
        if cid not in service.store:
            raise ServiceError(
                404, f"unknown context id {cid}; list them with GET /v1/contexts", "not_found_error"
            )
    if messages is not None:
        try:
            ids = prompt_ids(service.tokenizer, messages)
        except Exception as err:  # the chat template refused the conversation (raise_exception)
            if type(err).__module__.split(".")[0] != "jinja2":
                raise
            raise ServiceError(
                400, f"the model's chat template does not accept these messages: {err}"
            ) from err
        users = [m["content"] for m in messages if m["role"] == "user"]
        query = users[-1] if users else messages[-1]["content"]
    else:
        ids = list(service.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        query = prompt
    if not ids:
        raise ServiceError(400, "the prompt is empty")
    if len(ids) > limits.max_prompt_tokens:
        raise ServiceError(
            400,
            f"the prompt has {len(ids)} tokens, more than this server's limit of {limits.max_prompt_tokens}",
        )
    budget = min(req.context_budget or limits.max_context_tokens, limits.max_context_tokens)
    return {
        "prompt_ids": ids,
        "query": query,
        "contexts": list(req.contexts),
        "budget": budget,
        "retriever": req.retriever,
        "max_new_tokens": max_new,
        "temperature": 0.0 if (req.temperature or 0.0) < GREEDY_BELOW else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "seed": req.seed,
    }


class _Reply:
    """The response envelope of one completion: id, creation time, model, and chat or text shapes."""

    def __init__(self, service: CepeService, chat: bool, n_prompt: int) -> None:
        self.chat, self.n_prompt = chat, n_prompt
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = service.model_name

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self, text: str, info: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed answer."""
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": info["finish_reason"],
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": info["finish_reason"], "logprobs": None}
        return {
            **self.envelope("chat.completion" if self.chat else "text_completion", [choice]),
            "usage": _usage(self.n_prompt, info["completion_tokens"]),
            "cepe": _cepe_info(info),
        }

    def chunk(self, delta_text: str | None, finish: str | None, first: bool = False, extra=None) -> str:
        """One server-sent event of a stream."""
        if self.chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if delta_text:
                d["content"] = delta_text
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        obj = self.envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return f"data: {json.dumps({**obj, **(extra or {})})}\n\n"

    def usage_chunk(self, completion_tokens: int) -> str:
        obj = {
            **self.envelope("chat.completion.chunk" if self.chat else "text_completion", []),
            "usage": _usage(self.n_prompt, completion_tokens),
        }
        return f"data: {json.dumps(obj)}\n\n"


DISCONNECT_POLL_S = 0.25
"""How often a request that waits for the model (queued, or a whole answer) checks that its client is there."""


async def _until(fut: asyncio.Future, job: Job, request: Any) -> Any:
    """``await fut``, while checking every :data:`DISCONNECT_POLL_S` that the client of ``request`` is still
    connected: the server does not cancel a handler whose client left, so a client that leaves stops its
    job here (queued: it never runs; running: it stops at its next token). A job still queued at its
    deadline is cancelled and answered 503 then, however long the worker stays busy."""
    while True:
        left = job.deadline - time.monotonic()
        wait = DISCONNECT_POLL_S if job.started else min(DISCONNECT_POLL_S, max(left, 0.0))
        try:
            done, _ = await asyncio.wait({fut}, timeout=wait)
        except asyncio.CancelledError:
            job.cancel("client gone")
            raise
        if done:
            return fut.result()
        if time.monotonic() >= job.deadline and job.expire():
            raise ServiceError(503, "gave up waiting for the model (timeout)", "server_error")
        if request is not None and await request.is_disconnected():
            job.cancel("client gone")
            raise ServiceError(499, "the client closed the connection", "client_closed")


async def _complete(service: CepeService, req: Any, spec: dict[str, Any], chat: bool, request: Any = None):
    """Run ``spec`` on the model thread; the whole answer, or (``req.stream``) a stream of its tokens."""
    from fastapi.responses import StreamingResponse

    job = service.make_job(asyncio.get_running_loop(), spec)
    service.worker.submit(job)
    await _until(job.ready, job, request)  # contexts loaded: errors before this point are plain HTTP errors
    reply = _Reply(service, chat, len(spec["prompt_ids"]))
    if not req.stream:
        return await _whole_answer(service, job, reply, request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(
        _events(service, job, reply, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _whole_answer(service: CepeService, job: Job, reply: _Reply, request: Any = None) -> dict[str, Any]:
    delta = TextDelta(service.detokenizer)
    info = await _until(job.done, job, request)
    text = ""
    while not job.events.empty():
        kind, payload = job.events.get_nowait()
        if kind == "token":
            text += delta.push(payload)
    text += delta.push([], final=True)
    return reply.whole(text, info)


async def _events(service: CepeService, job: Job, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer; a client that leaves stops the generation."""
    delta = TextDelta(service.detokenizer)
    ended = False
    try:
        if reply.chat:
            yield reply.chunk(None, None, first=True)
        while True:
            kind, payload = await job.events.get()
            if kind == "token":
                piece = delta.push(payload)
                if piece:
                    yield reply.chunk(piece, None)
            elif kind == "end":
                ended = True
                rest = delta.push([], final=True)
                if rest:
                    yield reply.chunk(rest, None)
                yield reply.chunk(None, payload["finish_reason"], extra={"cepe": _cepe_info(payload)})
                if include_usage:
                    yield reply.usage_chunk(payload["completion_tokens"])
                yield "data: [DONE]\n\n"
                return
            else:  # an error after the first token: report it in the stream and end it
                err = payload
                msg = err.message if isinstance(err, ServiceError) else f"{type(err).__name__}: {err}"
                yield f"data: {json.dumps(_error_body(500, msg, 'server_error'))}\n\n"
                return
    finally:
        if not ended:
            job.cancel("client gone")  # the client left (or the stream failed): stop generating


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _cepe_info(info: dict[str, Any]) -> dict[str, Any]:
    out = {"timed_out": info["timed_out"], "stopped": info["stopped"]}
    if info.get("context"):
        out.update(info["context"])
    return out


def _context_view(meta: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "id",
        "name",
        "n_tokens",
        "n_chunks",
        "chunk_length",
        "dtype",
        "source_sha256",
        "created",
        "file_bytes",
    )
    return {"object": "context", **{k: meta[k] for k in keys if k in meta}}


def _store_call(fn, cid: str):
    try:
        return fn(cid)
    except ContextNotFound as err:
        raise ServiceError(404, str(err), "not_found_error") from err
    except CorruptContext as err:
        raise ServiceError(500, str(err), "server_error") from err


class BodyLimit:
    """ASGI middleware: no request body may exceed ``limit`` bytes (413), whether its length is declared
    or it arrives chunked; bodies are counted as they are received, never buffered here."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            from fastapi.responses import JSONResponse

            message = f"request body of {int(declared)} bytes exceeds the limit of {self.limit} bytes"
            body = {"error": {"message": message, "type": "invalid_request_error", "code": 413}}
            await JSONResponse(body, 413)(scope, receive, send)
            return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # an HTTPException passes through FastAPI's body parsing as it is
                    from starlette.exceptions import HTTPException

                    raise HTTPException(413, f"request body exceeds the limit of {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


def _parse_upload(body: bytes, content_type: str) -> tuple[str, str | None]:
    """``(text, name)`` of a ``POST /v1/contexts`` body: JSON ``{"text", "name"}`` or plain UTF-8 text."""
    if content_type.split(";")[0].strip().lower() == "application/json":
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ServiceError(400, f"malformed JSON body: {err}") from err
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise ServiceError(
                400, 'the JSON body must be an object with a "text" string (and optional "name")'
            )
        name = data.get("name")
        if name is not None and not isinstance(name, str):
            raise ServiceError(400, '"name" must be a string')
        text = data["text"]
        for what, value in (("the text", text), ('"name"', name or "")):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ServiceError(
                    400, f"{what} is not valid Unicode ({err.reason}); send it as UTF-8 text"
                ) from err
    else:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ServiceError(400, f"the text is not UTF-8 ({err.reason} at byte {err.start})") from err
        name = None
    if not text.strip():
        raise ServiceError(400, "the context text is empty")
    return text, name


# ---------------------------------------------------------------------------------------- running
def serve(
    model,
    tokenizer,
    store: ContextStore,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
    allow_no_auth: bool = False,
    model_name: str = "cepe",
    log_level: str = "info",
) -> None:
    """Run the server until SIGTERM / SIGINT (graceful shutdown, see the module docstring).

    Raises:
        ValueError: bound to a non-loopback address without an API key (and without ``allow_no_auth``).
    """
    import uvicorn

    limits = limits or ServeLimits()
    if host not in LOOPBACK and not api_key and not allow_no_auth:
        raise ValueError(
            f"--host {host} is reachable from other machines: set CEPE_API_KEY to require a bearer token "
            "(or pass --no-auth to serve without one)"
        )
    service = CepeService(model, tokenizer, store, limits, model_name)
    app = create_app(service, api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(limits.shutdown_grace_s) + 5,
        limit_concurrency=limits.max_queue + 64,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            service.worker.begin_shutdown(limits.shutdown_grace_s)
            super().handle_exit(sig, frame)

    server = Server(config)
    try:
        server.run()
    finally:
        service.worker.stop()
