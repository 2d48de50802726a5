"""scripts/device_kit.py: the decoder's GGUF file packed in two parts joins back to the same bytes on the
other side, one call at a time; a damaged piece is refused; ``slim`` takes the heavy folders out of what a
device call sends and ``unslim`` puts the index back as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import load_script


def _gguf(tmp_path):
    f = tmp_path / "src" / "Model.Q4_1.gguf"
    f.parent.mkdir()
    f.write_bytes(os.urandom(50_000) + b"\0" * 30_000)
    return f


def test_the_two_parts_join_back_to_the_file_one_call_at_a_time(tmp_path):
    mod = load_script("device_kit")
    gguf = _gguf(tmp_path)
    kit, store = tmp_path / "kit", tmp_path / "store"
    manifest = mod.pack(gguf, [], kit)
    assert manifest["pieces"] == 2 and manifest["wheels"] == []
    first = tmp_path / "call1"
    (first / "a").mkdir(parents=True)
    for f in (kit / "a").iterdir():
        if f.is_file():
            (first / "a" / f.name).write_bytes(f.read_bytes())
    assert mod.install(first, store) is False  # the first call: stored, waiting for part b
    assert not (store / "env.sh").exists()
    second = tmp_path / "call2"
    (second / "b").mkdir(parents=True)
    for f in (kit / "b").iterdir():
        (second / "b" / f.name).write_bytes(f.read_bytes())
    assert mod.install(second, store) is True
    joined = store / "site" / mod.PACKAGE / gguf.name
    assert joined.read_bytes() == gguf.read_bytes()
    assert (joined.parent / "__init__.py").is_file()
    assert f"{store / 'site'}:" in (store / "env.sh").read_text()
    assert mod.install(second, store) is True  # a later call finds it done


def test_a_damaged_piece_is_refused_and_no_gguf_is_left(tmp_path):
    mod = load_script("device_kit")
    gguf = _gguf(tmp_path)
    kit, store = tmp_path / "kit", tmp_path / "store"
    mod.pack(gguf, [], kit)
    piece = kit / "b" / "gguf.xz.01"
    data = bytearray(piece.read_bytes())
    data[-40] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="damaged"):
        mod.install(kit, store)
    assert not (store / "site" / mod.PACKAGE / gguf.name).exists()
    with pytest.raises(SystemExit, match="no kit here"):
        mod.install(tmp_path / "empty", tmp_path / "store2")


def _repo(tmp_path):
    root = tmp_path / "repo"
    for d in ("adapters", "results", "cepe"):
        (root / d).mkdir(parents=True)
        (root / d / "f.txt").write_text(d)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "."], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=root, check=True)
    return root


def _sent(root):  # what a device call sends: tracked plus untracked files git does not ignore
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    return sorted(out.stdout.split())


def test_slim_leaves_code_only_and_unslim_restores_the_index(tmp_path):
    mod = load_script("device_kit")
    root = _repo(tmp_path)
    assert _sent(root) == ["adapters/f.txt", "cepe/f.txt", "results/f.txt"]
    mod.slim(root)
    assert _sent(root) == ["cepe/f.txt"]
    assert (root / "adapters" / "f.txt").is_file()  # the files stay on disk
    mod.slim(root)  # twice is harmless
    mod.unslim(root)
    assert _sent(root) == ["adapters/f.txt", "cepe/f.txt", "results/f.txt"]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
    assert status == ""
    (root / "cepe" / "f.txt").write_text("changed")
    subprocess.run(["git", "add", "cepe/f.txt"], cwd=root, check=True)
    with pytest.raises(SystemExit, match="staged changes"):
        mod.slim(root)


def test_join_makes_an_adapter_directory_of_pieces_that_came_back(tmp_path):
    mod = load_script("device_kit")
    payload = os.urandom(9000)
    for i in range(3):
        (tmp_path / f"soup.int8.safetensors.part{i:02d}").write_bytes(payload[i * 3000 : (i + 1) * 3000])
    (tmp_path / "soup.cepe_config.json").write_text("{}")
    assert mod.main(["join", str(tmp_path / "soup"), str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == payload
    assert (tmp_path / "adapter" / "cepe_config.json").is_file()


def test_the_probes_part_unpacks_corpora_and_shims_beside_the_kit(tmp_path, monkeypatch):
    """``pack-probes`` → ``install``: the packages land on the kit's site path and the Austen package in
    the cache that env.sh names; ``cepe`` and ``python`` in the kit's bin run this interpreter."""
    mod = load_script("device_kit")
    lib = tmp_path / "lib"
    (lib / "fakecorpus").mkdir(parents=True)
    (lib / "fakecorpus" / "__init__.py").write_text("")
    (lib / "fakecorpus" / "essay.txt").write_text("a haystack")
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.setenv("CEPE_CACHE", str(tmp_path / "cache_here"))
    from cepe.data.corpora import corpora_dir

    austen = corpora_dir() / "debian" / mod.PROBE_DEBIAN
    (austen / "usr" / "data").mkdir(parents=True)
    (austen / "usr" / "data" / "Rdata.rdx").write_bytes(b"\x01\x02")
    kit, store = tmp_path / "kit", tmp_path / "store"
    gguf = _gguf(tmp_path)
    mod.pack(gguf, [], kit)
    mod.pack_probes([], kit, packages=("fakecorpus",), debian=austen)
    with pytest.raises(SystemExit, match="is not installed"):
        mod.pack_probes([], kit, packages=("no_such_corpus_package",), debian=austen)
    mod.pack_probes([], kit, packages=("fakecorpus",), debian=austen)
    only_a, only_b, only_c = (tmp_path / f"call_{part}" for part in "abc")
    for part, call in zip("abc", (only_a, only_b, only_c)):
        shutil.copytree(kit / part, call / part)  # each call carries one part
    assert mod.install(only_a, store) is False
    assert mod.install(only_c, store) is False  # the probes' part in between: unpacked, b still to come
    assert (store / "site" / "fakecorpus" / "essay.txt").read_text() == "a haystack"
    rdx = store / "cache" / "corpora" / "debian" / mod.PROBE_DEBIAN / "usr" / "data" / "Rdata.rdx"
    assert rdx.read_bytes() == b"\x01\x02"
    assert mod.install(only_b, store) is True
    env = (store / "env.sh").read_text()
    assert f'CEPE_CACHE="{store / "cache"}"' in env and f'PATH="{store / "bin"}:' in env
    out = subprocess.run(
        [str(store / "bin" / "python"), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True
    )
    assert out.stdout.strip() == sys.prefix  # the same interpreter, in its own environment
    assert os.access(store / "bin" / "cepe", os.X_OK)
