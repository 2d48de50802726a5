"""Limits of ``cepe serve`` (:class:`ServeLimits`): a plain dataclass, so the command line is built without
importing torch or the server."""

from __future__ import annotations

from dataclasses import dataclass

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


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
