"""Configurations of the context-store commands: ``cepe context add`` (:class:`ContextAddConfig`), ``cepe
context list / show / rm`` (:class:`StoreConfig`), ``cepe ask`` (:class:`AskConfig`) and ``cepe serve``
(:class:`ServeConfig`, with its :class:`ServeLimits`). Plain dataclasses, so the command line is built
without importing torch or the server; their fields are the commands' flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import CACHE_MODES

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
STORE_DTYPES = ("bf16", "fp32", "fp16")  # dtypes of a stored Φ (cepe.dtypes.torch_dtype)


@dataclass
class ServeLimits:
    """Limits of ``cepe serve`` (all per request except ``max_queue``).

    Attributes:
        max_queue: requests that may wait for the model (beyond the one running); more get 429.
        max_prompt_tokens: prompt tokens (after the chat template).
        max_new_tokens: the largest ``max_tokens`` a request may ask for.
        default_new_tokens: ``max_tokens`` when a request gives none.
        max_upload_bytes: size of a ``POST /v1/contexts`` body.
        max_context_tokens: context tokens attended to per request (beyond it: retrieval of chunks).
        request_timeout_s: time from arrival to the last token (queue wait included).
        shutdown_grace_s: how long a running request may continue after SIGTERM.
    """

    max_queue: int = 8
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 512
    default_new_tokens: int = 128
    max_upload_bytes: int = 4 * 2**20
    max_context_tokens: int = 131072
    request_timeout_s: float = 300.0
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        least = {  # each limit's smallest value that still serves a request
            "max_queue": 1,
            "max_prompt_tokens": 1,
            "max_new_tokens": 1,
            "default_new_tokens": 1,
            "max_upload_bytes": 1,
            "max_context_tokens": 1,
        }
        for name, low in least.items():
            value = getattr(self, name)
            if value < low:
                flag = SERVE_LIMIT_FLAGS[f"limits.{name}"][0]
                raise ValueError(f"{flag} must be at least {low}, got {value}: with it no request is served")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--timeout must be more than 0 seconds, got {self.request_timeout_s}")
        if not 0 <= self.shutdown_grace_s < float("inf"):  # NaN too
            raise ValueError(
                f"--shutdown-grace must be 0 seconds or more (a finite number), got {self.shutdown_grace_s}"
            )


SERVE_LIMIT_FLAGS = {
    "limits.max_queue": ["--max-queue"],
    "limits.max_prompt_tokens": ["--max-prompt-tokens"],
    "limits.max_new_tokens": ["--max-new-tokens"],
    "limits.default_new_tokens": ["--default-new-tokens"],
    "limits.max_upload_bytes": ["--max-upload-bytes"],
    "limits.max_context_tokens": ["--max-context-tokens"],
    "limits.request_timeout_s": ["--timeout"],
    "limits.shutdown_grace_s": ["--shutdown-grace"],
}
"""The short flags of the limits (``--max-queue`` for ``--limits.max-queue``, ``--timeout``, ...)."""


@dataclass
class StoreConfig:
    """A context store opened without a model (``cepe context list / show / rm``).

    Attributes:
        store: the store directory.
        json: print JSON (``list``).
    """

    store: str
    json: bool = False


@dataclass
class ContextAddConfig:
    """``cepe context add``: the store and the model that encodes into it.

    Attributes:
        store: store directory (created if missing).
        model: a CEPE adapter directory (as for ``cepe generate``), a plain decoder (``default``: the
            project's decoder, with an untrained encoder built the same in every process, so a store
            stays readable but the context cannot help yet) or ``tiny`` (a random test model).
        dtype: storage dtype of a new store (an existing store keeps its own).
    """

    store: str
    model: str = "default"
    dtype: str = field(default="bf16", metadata={"choices": STORE_DTYPES})


@dataclass
class AskConfig:
    """``cepe ask``: answer a question from stored contexts.

    Attributes:
        store: the store directory.
        context: context id(s), comma-separated.
        model: the model that wrote the store (as for ``cepe context add``; default ``default``).
        max_new_tokens: tokens generated (greedy).
        budget: attend to at most this many context tokens (the chunks selected by ``retriever``; default:
            all of them).
        retriever: chunk selection over the budget.
        cache: the cross-attention cache while decoding (default: the model's).
        json: print the answer and the context metadata as JSON.
    """

    store: str
    context: str
    model: str = "default"
    max_new_tokens: int = 64
    budget: int | None = None
    retriever: str = field(default="bm25", metadata={"choices": ("bm25", "dense")})
    cache: str | None = field(default=None, metadata={"choices": CACHE_MODES})
    json: bool = False

    def context_ids(self) -> list[str]:
        """The ids of ``context``."""
        return [i.strip() for i in self.context.split(",") if i.strip()]


@dataclass
class ServeConfig:
    """``cepe serve``: the OpenAI-compatible server over one model and a context store. The API key is
    not a setting: it is read from ``CEPE_API_KEY``.

    Attributes:
        store: context store directory (created if missing).
        model: a CEPE adapter directory (as for ``cepe generate``), a plain decoder (``default``: the
            project's decoder, with an untrained encoder built the same in every process, so a store
            stays readable but the context cannot help yet) or ``tiny`` (a random test model).
        dtype: storage dtype of a new store.
        host: bind address (default loopback only; another needs ``CEPE_API_KEY`` or ``allow_no_auth``).
        port: TCP port.
        allow_no_auth: serve on a non-loopback host without ``CEPE_API_KEY`` (``--no-auth``).
        model_name: model id reported to clients (default: the model directory's name).
        threads: torch threads (0: torch's default).
        log_level: uvicorn's log level.
        limits: request limits (:class:`ServeLimits`; also ``--max-queue``, ``--timeout``, ...).
    """

    store: str
    model: str = "default"
    dtype: str = field(default="bf16", metadata={"choices": STORE_DTYPES})
    host: str = "127.0.0.1"
    port: int = 8000
    allow_no_auth: bool = False
    model_name: str | None = None
    threads: int = 0
    log_level: str = "warning"
    limits: ServeLimits = field(default_factory=ServeLimits)
