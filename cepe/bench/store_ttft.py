"""``cepe bench-store``: time to first token over a stored context, against re-encoding it and against
full-context prefill, and the store's bytes per token against full-context K/V bytes.

For each context length T (random token ids: costs do not depend on the values), one run makes one
untimed encode + first token at that length (allocation and kernel choice at a new shape), then measures,
in this order and in one process:

- ``reencode``: chunk the T ids, encode them (``encode_context``), prefill the question with
  cross-attention to Φ and produce the first answer token (tokenizing the text is not counted, which
  favours re-encoding).
- the store write of that Φ (not part of any time to first token).
- ``stored_cold``: a freshly opened :class:`cepe.store.ContextStore` maps the file, checks its SHA-256,
  casts Φ to the model dtype, prefills the question and produces the first token.
- ``stored_warm``: the same again on the open store (hash already checked; file pages cached).
- ``full`` (only for T ≤ ``full_max_tokens``): the decoder reads the T tokens and the question
  (chunked prefill into its K/V cache) and produces the first token.

All three paths run the same model in one dtype (``dtype``: ``fp32``, the default, or ``bf16``, loaded in
that dtype as ``cepe bench`` does; full-context prefill at 128K tokens takes hours in fp32 on a 2-core CPU),
so the comparison stays fair. ``first_token_same``: the re-encoded and the two stored runs produced the
same first token. The stored Φ is rounded to ``store_dtype`` and cast back to the model dtype; where the
two differ (an fp32 model with a bf16 store), the rounding can flip a near-tie between the two most likely
tokens, which the markdown then says.

While the run goes on, ``bench_store.partial.json`` (in ``out_dir``) holds the rows measured so far, each as
``bench_store.json`` will hold it (:class:`cepe.bench.report.PartialRows`, as ``cepe bench`` does), so a run
stopped part-way keeps them; it is removed once ``bench_store.json`` and ``bench_store.md`` are written. A
new run starts over, so the file is a record, not a resume point.

Ratios are taken within the run. Bytes per token: the stored file size over T, Φ alone
(``D_enc`` × dtype bytes) and full-context K/V (2 × layers × KV heads × head dim × dtype bytes).
Shape legend: T context tokens, S encoder positions, D = D_enc.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..chunking import chunk_ids
from ..dtypes import torch_dtype
from ..fileio import write_text
from ..tables import pipe_table
from .config import DTYPE_NAMES, StoreBenchConfig
from .report import PartialRows

# the rows measured so far (see PartialRows): a record, not a resume point
PARTIAL = "bench_store.partial.json"
QUESTION = "What is the main point of the document above? Answer in one sentence."


def _first_token_cepe(model, prompt: torch.Tensor, cache: str, **enc) -> int:
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=1,
        do_sample=False,
        cross_attention_cache=cache,
        **enc,
    )
    return int(out[0, -1])


@torch.no_grad()
def _first_token_full(model, ids: torch.Tensor, prompt: torch.Tensor, chunk: int) -> int:
    from transformers import DynamicCache

    x = torch.cat([ids[None], prompt], dim=1)  # (1, T + prompt)
    cache = DynamicCache()
    logits = None
    with model.use_context(None):
        for s in range(0, x.shape[1], chunk):
            part = x[:, s : s + chunk]
            out = model.decoder(input_ids=part, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits
    return int(logits[0, -1].argmax())


def kv_bytes_per_token(decoder_config, dtype_bytes: int) -> int:
    """Full-context K/V bytes per token: 2 × layers × KV heads × head dim × bytes."""
    c = decoder_config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * dtype_bytes


def _log(*parts: Any) -> None:
    print(*parts, flush=True)  # a run stopped from outside keeps what it measured in its log


@torch.no_grad()
def run_store_bench(
    cfg: StoreBenchConfig, out_dir: str | os.PathLike[str] | None = None, log=_log
) -> dict[str, Any]:
    """Measure every length of ``cfg`` (see the module docstring).

    Returns:
        ``{"config", "question_tokens", "machine", "rows", "bytes"}``; also written to
        ``out_dir/bench_store.{json,md}`` (None: write nothing). While the run goes on,
        ``out_dir/bench_store.partial.json`` holds the rows measured so far; it is removed at the end.
    """
    from ..generation import load_model_and_tokenizer
    from ..store import ContextStore, prompt_ids

    if cfg.dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {cfg.dtype!r}")
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    model, tok = load_model_and_tokenizer(cfg.model, dtype=torch_dtype(cfg.dtype))
    log(
        f"model {cfg.model} loaded in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}"
    )
    vocab = int(model.decoder.config.vocab_size)
    length = int(model.cepe_config.chunk_length)
    prompt = torch.tensor([prompt_ids(tok, [{"role": "user", "content": QUESTION}])])
    g = torch.Generator().manual_seed(cfg.seed)
    machine = (
        f"{platform.machine()} cpu x{os.cpu_count()}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, model dtype {str(model.dtype).removeprefix('torch.')}"
    )
    out = Path(out_dir) if out_dir is not None else None
    # a run stopped part-way (they take many minutes per 128K row) keeps the rows it measured
    partial = PartialRows(
        out / PARTIAL if out is not None else None,
        config=asdict(cfg),
        question_tokens=int(prompt.shape[1]),
        machine=machine,
    )
    rows = partial.rows
    with tempfile.TemporaryDirectory(prefix="cepe-bench-store-") as tmp:
        store = ContextStore(Path(tmp) / "store", model, tok, dtype=cfg.store_dtype)
        # warm-up: first calls allocate and pick kernels
        warm_ids = torch.randint(0, vocab, (4 * length,), generator=g)
        c, m = chunk_ids(warm_ids, length)
        s, k = model.encode_context(c[None], m[None])
        _first_token_cepe(model, prompt, cfg.cache, **_encoded(model, c, s, k))
        for n in cfg.lengths:
            ids = torch.randint(0, vocab, (n,), generator=g)
            partial.append(_measure_length(cfg, model, tok, store, prompt, ids, log))
    result = {
        **partial.header,  # config, question_tokens, machine
        "rows": rows,
        "bytes": _bytes_summary(cfg, model, rows),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "bench_store.json", json.dumps(result, indent=2) + "\n")
        write_text(out / "bench_store.md", format_markdown(result))
        partial.done()  # last: the final files hold every row
    return result


def _encoded(model, chunks, states, key_mask) -> dict[str, torch.Tensor]:
    """The context arguments of a first token from just-encoded ``states`` ``(1, S, D)`` of ``chunks``
    ``(K, L)``: with a mixture that matches the context's ids (``reads_context_ids``) the ids too (their
    padding is masked by ``key_mask`` in ``prepare_context``)."""
    kw = {"encoder_hidden_states": states, "encoder_attention_mask": key_mask}
    if getattr(model, "reads_context_ids", False):
        kw["encoder_input_ids"] = chunks.reshape(1, -1)
    return kw


def _measure_length(
    cfg: StoreBenchConfig, model, tok, store, prompt: torch.Tensor, ids: torch.Tensor, log
) -> dict[str, Any]:
    """One row: time to first token re-encoding the ``n`` context tokens ``ids``, from the store (cold: a
    freshly opened store; warm: read again) and (up to ``full_max_tokens``) by a full-context prefill."""
    from ..store import ContextStore

    n = len(ids)
    length = int(model.cepe_config.chunk_length)
    row: dict[str, Any] = {"tokens": n, "load_avg_start": os.getloadavg()[0]}
    # Untimed pass at this length first: the first call at a new shape allocates and picks kernels (in
    # bf16 that alone made the timed re-encode 3x slower than the stored path that followed it), so the
    # timed paths all start equally warm.
    c, m = chunk_ids(ids, length)
    s, k = model.encode_context(c[None], m[None])
    _first_token_cepe(model, prompt, cfg.cache, **_encoded(model, c, s, k))
    del c, m, s, k
    t = time.perf_counter()
    chunks, mask = chunk_ids(ids, length)
    states, key_mask = model.encode_context(chunks[None], mask[None])
    row["encode_s"] = time.perf_counter() - t
    tok_re = _first_token_cepe(model, prompt, cfg.cache, **_encoded(model, chunks, states, key_mask))
    row["ttft_reencode_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cid, _ = store.add_token_ids(ids.tolist(), name=f"random-{n}", encoded=(states, key_mask))
    row["store_write_s"] = time.perf_counter() - t
    row["file_bytes"] = store.show(cid)["file_bytes"]
    del states, key_mask
    fresh = ContextStore(store.path, model, tok)
    t = time.perf_counter()
    ctx = fresh.context([cid])
    tok_cold = _first_token_cepe(model, prompt, cfg.cache, **ctx.encoder_kwargs())
    row["ttft_stored_cold_s"] = time.perf_counter() - t
    row["stored_load_s"] = ctx.timings["load_s"] + ctx.timings["gather_s"]
    del ctx
    t = time.perf_counter()
    ctx = fresh.context([cid])
    tok_warm = _first_token_cepe(model, prompt, cfg.cache, **ctx.encoder_kwargs())
    row["ttft_stored_warm_s"] = time.perf_counter() - t
    del ctx
    row["first_token_same"] = tok_re == tok_cold == tok_warm
    log(
        f"T={n}: ttft stored {row['ttft_stored_cold_s']:.2f} s (warm {row['ttft_stored_warm_s']:.2f}), "
        f"re-encode {row['ttft_reencode_s']:.2f} s (encode {row['encode_s']:.2f})"
    )
    if n <= cfg.full_max_tokens:
        log(f"T={n}: full-context prefill ...")
        t = time.perf_counter()
        _first_token_full(model, ids, prompt, cfg.full_chunk)
        row["ttft_full_s"] = time.perf_counter() - t
    else:
        row["ttft_full_s"] = None
        row["full_skipped"] = f"T > full_max_tokens ({cfg.full_max_tokens})"
    row["reencode_over_stored"] = row["ttft_reencode_s"] / row["ttft_stored_cold_s"]
    if row["ttft_full_s"] is not None:
        row["full_over_stored"] = row["ttft_full_s"] / row["ttft_stored_cold_s"]
    row["load_avg_end"] = os.getloadavg()[0]
    if row["ttft_full_s"] is not None:
        log(f"T={n}: full {row['ttft_full_s']:.2f} s")
    store.remove(cid)
    return row


def _bytes_summary(cfg: StoreBenchConfig, model, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes per context token: Φ (in the store's dtype), the full context's K/V, the stored files."""
    dtype_bytes = torch.tensor([], dtype=torch_dtype(cfg.store_dtype)).element_size()
    kv = kv_bytes_per_token(model.decoder.config, dtype_bytes)
    phi = int(model.cepe_config.encoder.state_size) * dtype_bytes
    return {
        "store_dtype": cfg.store_dtype,
        "phi_bytes_per_token": phi,
        "full_kv_bytes_per_token": kv,
        "phi_over_kv": phi / kv,
        "file_bytes_per_token": {str(r["tokens"]): r["file_bytes"] / r["tokens"] for r in rows},
        "file_over_kv": {str(r["tokens"]): r["file_bytes"] / r["tokens"] / kv for r in rows},
    }


def busy_warning(result: dict[str, Any], cpus: int | None = None) -> str | None:
    """A warning line when the machine was busy while the rows were measured: the 1-minute load average
    (recorded per row) above the CPU count the result names, so other work shared the cores and the times
    and their ratios are uncertain; None otherwise."""
    import re

    if cpus is None:
        m = re.search(r"cpu x(\d+)", str(result.get("machine", "")))
        cpus = int(m.group(1)) if m else None
    loads = [r[k] for r in result.get("rows", []) for k in ("load_avg_start", "load_avg_end") if k in r]
    if not cpus or not loads or max(loads) <= cpus:
        return None
    return (
        f"**Measured on a busy machine:** load average {min(loads):.1f}-{max(loads):.1f} on {cpus} CPUs while "
        "these rows ran; other work shared the cores, so the times, and the ratios between them, are "
        "uncertain. Rerun on an idle machine to rely on them."
    )


def format_markdown(result: dict[str, Any]) -> str:
    """The result as a markdown table (the README's figures)."""
    b = result["bytes"]
    lines = [
        f"# cepe bench-store ({result['machine']})",
        "",
        f"Question: {result['question_tokens']} tokens; cross-attention cache while producing the first token: "
        f"`{result['config']['cache']}`; model dtype {result['config'].get('dtype', 'fp32')} (every path); "
        f"store dtype {b['store_dtype']}.",
        "",
    ]
    busy = busy_warning(result)
    if busy:
        lines += [busy, ""]
    head = ["context tokens", "TTFT stored (cold)", "stored (warm)", "re-encode", "full prefill"]
    head += ["re-encode / stored", "full / stored", "same first token"]
    lines += pipe_table(
        head,
        (
            [
                r["tokens"],
                f"{r['ttft_stored_cold_s']:.2f} s",
                f"{r['ttft_stored_warm_s']:.2f} s",
                f"{r['ttft_reencode_s']:.2f} s (encode {r['encode_s']:.2f})",
                f"{r['ttft_full_s']:.2f} s" if r["ttft_full_s"] is not None else "not run",
                f"{r['reencode_over_stored']:.1f}x",
                f"{r['full_over_stored']:.1f}x" if "full_over_stored" in r else "-",
                r["first_token_same"],
            ]
            for r in result["rows"]
        ),
    )
    lines += [
        "",
        f"Bytes per context token: Φ {b['phi_bytes_per_token']} B, full-context K/V {b['full_kv_bytes_per_token']} B "
        f"(ratio {b['phi_over_kv']:.4f}); stored file (Φ + key mask + token id + header): "
        + ", ".join(f"{k} tokens {v:.1f} B" for k, v in b["file_bytes_per_token"].items())
        + " ("
        + ", ".join(f"{v:.4f}" for v in b["file_over_kv"].values())
        + " of K/V).",
        "",
    ]
    differ = [str(r["tokens"]) for r in result["rows"] if not r["first_token_same"]]
    if differ:
        model_dtype = result["config"].get("dtype", "fp32")
        if b["store_dtype"] != model_dtype:
            why = (
                f"the stored Φ is rounded to {b['store_dtype']} and read back into the {model_dtype} model, which "
                "can flip a near-tie between the two most likely tokens"
            )
        else:
            why = (
                f"unexpected: the store keeps Φ in the model's dtype ({model_dtype}), so the stored and re-encoded "
                "states are the same numbers"
            )
        lines += [
            f"The first token differs between the stored and re-encoded runs at {', '.join(differ)} tokens: {why}.",
            "",
        ]
    return "\n".join(lines)
