"""Atomic file writes: the one temp-file-and-rename helper every writer uses.

A file is written to a temporary name in the same directory (or in ``tmp_dir``, which must be on the same
file system), flushed (and ``fsync``-ed when asked), given the permissions a plain ``open(path, "w")``
would give it (an existing file's own, else ``0o666`` minus the umask, unless ``mode`` says otherwise) and
renamed over the target with ``os.replace``: a reader sees the old file or the new one, never a
half-written one; on an error the temporary file is removed. Stdlib only.

Directory swaps (checkpoints, prepared corpora, downloads) follow the same idea with ``tempfile.mkdtemp``
next to the target; they stay with their writers because each one also decides what to do with the old
directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike[str],
    *,
    tmp_dir: str | os.PathLike[str] | None = None,
    prefix: str | None = None,
    suffix: str = ".tmp",
    fsync: bool = False,
    mode: int | None = None,
) -> Iterator[Path]:
    """Yield a temporary path to write; on leaving the block it replaces ``path`` (removed on error).

    Args:
        path: the final file.
        tmp_dir: where the temporary file goes (default: ``path``'s directory; same file system).
        prefix: temporary name prefix (default ``.<name>.``); a leading dot keeps it out of listings.
        suffix: temporary name suffix (e.g. ``.safetensors`` for writers that look at it).
        fsync: ``fsync`` the file before the rename (durable across a power loss, slower).
        mode: file permissions (default: as ``open`` would leave them: those of the file it replaces, or
            ``0o666`` minus the umask for a new file).
    """
    path = Path(path)
    where = Path(tmp_dir) if tmp_dir is not None else path.parent
    fd, name = tempfile.mkstemp(
        prefix=prefix if prefix is not None else f".{path.name}.", suffix=suffix, dir=where
    )
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        if mode is None:
            try:  # a file made private (0600) stays private when it is written again
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except FileNotFoundError:
                mode = 0o666 & ~umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes(path: str | os.PathLike[str], data: bytes, **options: Any) -> None:
    """Atomically write ``data`` to ``path`` (``options`` as for :func:`atomic_path`)."""
    with atomic_path(path, **options) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike[str], text: str, **options: Any) -> None:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    write_bytes(path, text.encode("utf-8"), **options)


def write_json(
    path: str | os.PathLike[str],
    obj: Any,
    *,
    indent: int | None = 2,
    sort_keys: bool = False,
    ensure_ascii: bool = True,
    default: Any = None,
    **options: Any,
) -> None:
    """Atomically write ``obj`` as JSON followed by a newline."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, default=default)
    write_text(path, text + "\n", **options)
