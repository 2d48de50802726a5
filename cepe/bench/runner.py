"""Measuring one benchmark setting: model construction, the prefill of each method, decoding.

A *setting* is a dict: ``{"kind": "prefill", "method": m, "tokens": T}`` or
``{"kind": "decode", "method": "full" | "cepe", "mode": cache mode, "context": T, "tokens": N}``.
:func:`run_setting` measures one; ``python -m cepe.bench.runner CONFIG_JSON SETTING_JSON`` runs it in a
fresh process (one per setting, so peak-memory numbers do not inherit an earlier run's heap) and prints
the result as one JSON line.

Methods, all on the same frozen decoder (the CEPE model's decoder with its cross-attention idle):

- ``cepe``: the last ``window`` tokens in the decoder, the rest through the encoder in chunks; the prefill
  keeps Φ and the decoder's K/V cache (cache mode ``states`` during prefill: K/V projected per layer and
  dropped), ready to generate with any cache mode.
- ``full``: the decoder reads all tokens, ``full_chunk`` tokens per call into its K/V cache (chunked
  prefill), logits only for the last position. Beyond the decoder's trained positions the rotary
  positions are simply extended: what is measured is cost, not quality.
- ``streamingllm``: :class:`cepe.eval.streaming.StreamingLLM` (4 sinks, ``window - 4`` recent tokens,
  stride ``window``) scoring the last token.
- ``replug``: :class:`cepe.eval.replug.Replug`: the last ``window - replug_piece`` tokens are the input,
  every ``replug_piece`` tokens before them one pass (piece + input), scoring the last token.

Random token ids are used: costs do not depend on the values.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from cepe.dtypes import torch_dtype
from cepe.measure import PeakRSS, tensor_bytes

from .config import PREFILL_METHODS, BenchConfig
from .flops import CostModel, DecoderShape

RESULT_TAG = "CEPE_BENCH_RESULT "  # marks the result line a worker prints


# ---------------------------------------------------------------------------------------------- models
def build_model(cfg: BenchConfig) -> torch.nn.Module:
    """The CEPE model over the configured decoder, in the benchmark dtype, eval mode."""
    cfg = cfg.resolved()
    from transformers import AutoConfig, AutoModelForCausalLM

    from cepe import CepeConfig, CepeForCausalLM, EncoderConfig

    torch.manual_seed(cfg.seed)
    if cfg.model == "tiny":
        from cepe.tiny import tiny_decoder

        decoder = tiny_decoder(seed=cfg.seed, max_positions=max([4096, *cfg.lengths]))
    elif cfg.random_init:
        from cepe.assets import resolve_decoder

        decoder = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_decoder(cfg.model)))
    else:
        from cepe.assets import load_decoder_model

        decoder = load_decoder_model(cfg.model)
    vocab = int(decoder.config.vocab_size)
    enc = EncoderConfig(
        vocab_size=vocab + 1,
        hidden_size=cfg.encoder_hidden,
        num_hidden_layers=cfg.encoder_layers,
        num_attention_heads=cfg.encoder_heads,
        mask_token_id=vocab,
    )
    ccfg = CepeConfig(
        encoder=enc,
        chunk_length=cfg.chunk,
        cross_attention_cache="states",
        encoder_micro_batch=cfg.micro_batch,
    )
    model = CepeForCausalLM.from_decoder(decoder.eval(), ccfg).to(torch_dtype(cfg.dtype)).eval()
    longest = max([*cfg.lengths, cfg.decode_context + cfg.decode_tokens + 1])
    if getattr(model.decoder.config, "max_position_embeddings", longest) < longest:
        # Rotary positions are computed from position ids, so longer inputs run; only cost is measured.
        model.decoder.config.max_position_embeddings = longest
    if cfg.compile:
        for layer in model.encoder.layers:
            layer.compile(dynamic=False)
        for m in model.cross_attention_modules():
            m.compile(dynamic=True)
    return model


def cost_model(model: torch.nn.Module, cfg: BenchConfig) -> CostModel:
    """The analytical cost model of ``model`` under ``cfg``."""
    return CostModel(
        dec=DecoderShape.from_hf_config(model.decoder.config),
        enc=DecoderShape.from_encoder_config(model.cepe_config.encoder),
        cross_layers=len(model.cross_layers),
        window=cfg.window,
        chunk=cfg.chunk,
        full_chunk=cfg.full_chunk,
        replug_piece=cfg.replug_piece,
    )


def random_ids(total: int, vocab: int, seed: int) -> torch.Tensor:
    """``(1, total)`` random token ids (ids 0..vocab-1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, total), generator=g)


# ---------------------------------------------------------------------------------------------- prefill
def _new_cache(model: torch.nn.Module, max_length: int | None = None):
    """A decoder cache: dynamic (``max_length`` None) or static, preallocated for ``max_length`` positions."""
    from transformers import DynamicCache, StaticCache

    if max_length is None:
        return DynamicCache(config=model.decoder.config)
    return StaticCache(config=model.decoder.config, max_cache_len=int(max_length))


def cepe_prefill(
    model: torch.nn.Module, ids: torch.Tensor, window: int, mode: str = "states", cache: Any = None
) -> dict[str, Any]:
    """CEPE prefill of ``ids`` ``(1, T)``: encode all but the last ``window`` tokens, run the decoder on
    those with cross-attention (into ``cache``, a new dynamic cache by default). Returns the kept state
    ``{"context", "cache", "logits"}``."""
    from cepe.chunking import chunk_ids

    n = min(window, ids.shape[1])
    ctx_ids, dec_ids = ids[:, : ids.shape[1] - n], ids[:, ids.shape[1] - n :]
    ctx = None
    if ctx_ids.shape[1]:
        chunks, mask = chunk_ids(ctx_ids[0], model.cepe_config.chunk_length)
        ctx = model.prepare_context(chunks[None], mask[None], cross_attention_cache=mode)
    cache = _new_cache(model) if cache is None else cache
    out = model(input_ids=dec_ids, cross_context=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return {"context": ctx, "cache": cache, "logits": out.logits}


def full_prefill(model: torch.nn.Module, ids: torch.Tensor, chunk: int, cache: Any = None) -> dict[str, Any]:
    """Full-context prefill: the decoder reads ``ids`` ``(1, T)`` ``chunk`` tokens per call into its K/V
    cache (a new dynamic cache by default); logits of the last position only."""
    cache = _new_cache(model) if cache is None else cache
    logits = None
    for a in range(0, ids.shape[1], chunk):
        out = model.decoder(
            input_ids=ids[:, a : a + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        logits = out.logits
    return {"cache": cache, "logits": logits}


def streaming_prefill(model: torch.nn.Module, ids: torch.Tensor, window: int) -> dict[str, Any]:
    """StreamingLLM (the evaluation baseline) reading ``ids`` and scoring its last token."""
    from cepe.eval.methods import Request
    from cepe.eval.streaming import StreamingLLM

    method = StreamingLLM(model.decoder, sink_tokens=4, recent_tokens=window - 4, stride=window)
    return {"logprobs": method.score([Request(ids[0].tolist(), num_targets=1)])}


def replug_prefill(model: torch.nn.Module, ids: torch.Tensor, window: int, piece: int) -> dict[str, Any]:
    """REPLUG (the evaluation baseline): input = last ``window - piece`` tokens, one pass per piece."""
    from cepe.eval.methods import Request
    from cepe.eval.replug import Replug

    flat = ids[0].tolist()
    inp = min(window - piece, len(flat))
    ctx = flat[: len(flat) - inp]
    pieces = [ctx[i : i + piece] for i in range(0, len(ctx), piece)]
    method = Replug(model.decoder, batch_size=1)
    return {"logprobs": method.score([Request(flat[len(flat) - inp :], num_targets=1, context=pieces)])}


def prefill(model: torch.nn.Module, cfg: BenchConfig, method: str, ids: torch.Tensor) -> dict[str, Any]:
    """Run the prefill of ``method`` on ``ids`` ``(1, T)``; returns what it keeps."""
    if method == "cepe":
        return cepe_prefill(model, ids, cfg.window)
    if method == "full":
        return full_prefill(model, ids, cfg.full_chunk)
    if method == "streamingllm":
        return streaming_prefill(model, ids, cfg.window)
    if method == "replug":
        return replug_prefill(model, ids, cfg.window, cfg.replug_piece)
    raise ValueError(f"unknown prefill method {method!r}; choose from {', '.join(PREFILL_METHODS)}")


def measure_prefill(model: torch.nn.Module, cfg: BenchConfig, method: str, total: int) -> dict[str, Any]:
    """Time and measure the memory of one prefill of ``total`` tokens (after an untimed warm-up)."""
    cm = cost_model(model, cfg)
    vocab = int(model.decoder.config.vocab_size)
    warm = min(total, cfg.window + 2 * cfg.chunk)
    with torch.inference_mode():
        prefill(model, cfg, method, random_ids(warm, vocab, cfg.seed + 1))  # kernels, thread pools
        ids = random_ids(total, vocab, cfg.seed)
        times = []
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            state = prefill(model, cfg, method, ids)
            times.append(time.perf_counter() - t0)
        kept = tensor_bytes(state.get("cache"), state.get("context"))
        del state
        for _ in range(cfg.repeats - 1):
            t0 = time.perf_counter()
            state = prefill(model, cfg, method, ids)
            times.append(time.perf_counter() - t0)
            del state
    seconds = min(times)  # best of ``repeats``: the least disturbed by other load
    flops = cm.prefill(method, total)
    return {
        "seconds": seconds,
        "all_seconds": times,
        "tokens_per_s": total / seconds,
        "flops": flops,
        "flops_per_s": flops / seconds,
        "kept_tensor_bytes": kept,
        "kept_bytes_model": cm.cache_bytes(  # at the benchmark dtype's element size (fp32: 4 bytes)
            method, total, bytes_per_elem=torch_dtype(cfg.dtype).itemsize
        ),
        "rss_baseline_bytes": mem.baseline,
        "peak_rss_bytes": mem.peak,
        "peak_delta_bytes": mem.peak_delta,
        "kept_rss_delta_bytes": mem.kept_delta,
        "memory_method": mem.method,
    }


# ---------------------------------------------------------------------------------------------- decode
def _random_cache(model: torch.nn.Module, length: int, seed: int, max_length: int | None = None):
    """A decoder K/V cache of ``length`` positions filled with random values (static with room for
    ``max_length`` positions when given, else dynamic)."""
    shape = DecoderShape.from_hf_config(model.decoder.config)
    cache = _new_cache(model, max_length)
    g = torch.Generator().manual_seed(seed)
    dtype = model.dtype
    for i in range(shape.layers):
        k = torch.randn(1, shape.kv_heads, length, shape.head_dim, generator=g).to(dtype)
        v = torch.randn(1, shape.kv_heads, length, shape.head_dim, generator=g).to(dtype)
        cache.update(k, v, i)
    return cache


def measure_decode(
    model: torch.nn.Module, cfg: BenchConfig, method: str, mode: str | None, context: int
) -> dict[str, Any]:
    """Greedy decoding speed after ``context`` tokens: one untimed step, then ``decode_tokens`` timed.

    ``method`` ``"full"``: the decoder with a K/V cache of ``context`` positions. ``"cepe"``: ``window``
    positions in the decoder cache and ``context - window`` encoder states read with cache ``mode``.
    """
    cm = cost_model(model, cfg)
    vocab = int(model.decoder.config.vocab_size)
    n, s = cm.split(context)
    kept = context if method == "full" else n  # positions in the decoder cache before decoding
    room = kept + cfg.decode_tokens + 1 if cfg.decode_cache == "static" else None
    with torch.inference_mode():
        ctx = None
        if cfg.decode_fill == "prefill":
            ids = random_ids(context, vocab, cfg.seed)
            if method == "full":
                state = full_prefill(model, ids, cfg.full_chunk, cache=_new_cache(model, room))
            else:
                state = cepe_prefill(model, ids, cfg.window, mode, cache=_new_cache(model, room))
            cache, ctx = state["cache"], state.get("context")
        else:
            cache = _random_cache(model, kept, cfg.seed, room)
            if method != "full":
                g = torch.Generator().manual_seed(cfg.seed + 2)
                phi = torch.randn(1, s, model.cepe_config.encoder.state_size, generator=g).to(model.dtype)
                ctx = model.prepare_context(encoder_hidden_states=phi, cross_attention_cache=mode)
        tok = torch.zeros(1, 1, dtype=torch.long)
        times = []
        for step in range(cfg.decode_tokens + 1):
            t0 = time.perf_counter()
            pos = torch.tensor([kept + step])  # given, so a static cache needs no scan for its length
            if method == "full":
                out = model.decoder(
                    input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1, cache_position=pos
                )
            else:
                out = model(
                    input_ids=tok,
                    cross_context=ctx,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    cache_position=pos,
                )
            tok = out.logits[:, -1:].argmax(-1)
            if step:  # the first step projects K/V in mode "kv" and warms kernels up
                times.append(time.perf_counter() - t0)
        kept = tensor_bytes(cache, ctx)
    seconds = sum(times)
    flops = cm.decode_step(method, context, mode or "kv")
    return {
        "seconds": seconds,
        "tokens": len(times),
        "tokens_per_s": len(times) / seconds,
        "ms_per_token": 1000 * seconds / len(times),
        "flops_per_token": flops,
        "flops_per_s": flops * len(times) / seconds,
        "kept_tensor_bytes": kept,
        "fill": cfg.decode_fill,
        "cache": cfg.decode_cache,
    }


def run_setting(
    cfg: BenchConfig, setting: dict[str, Any], model: torch.nn.Module | None = None
) -> dict[str, Any]:
    """Measure one setting (building the model unless given); returns the setting with its results."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = model if model is not None else build_model(cfg)
    if setting["kind"] == "prefill":
        res = measure_prefill(model, cfg, setting["method"], int(setting["tokens"]))
    elif setting["kind"] == "decode":
        res = measure_decode(model, cfg, setting["method"], setting.get("mode"), int(setting["context"]))
    else:
        raise ValueError(f"unknown setting kind {setting['kind']!r}")
    return {**setting, **res, "threads": torch.get_num_threads()}


def matmul_peak_flops(
    size: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    seconds: float = 2.0,
    device: str | torch.device = "cpu",
) -> float:
    """Measured FLOP/s of a large square matmul in ``dtype`` on ``device``: ``torch.utils.benchmark`` runs it
    in blocks for at least ``seconds`` (after a warm-up call) on this process's threads; the fastest block
    counts. On an accelerator the timer synchronizes it around every block."""
    from torch.utils import benchmark

    a = torch.randn(size, size).to(device=device, dtype=dtype)
    b = torch.randn(size, size).to(device=device, dtype=dtype)
    torch.matmul(a, b)
    timer = benchmark.Timer(
        "torch.matmul(a, b)", globals={"torch": torch, "a": a, "b": b}, num_threads=torch.get_num_threads()
    )
    best = min(timer.blocked_autorange(min_run_time=seconds).times)
    return 2 * size**3 / best


def main(argv: list[str] | None = None) -> int:
    """Worker entry: ``CONFIG_JSON SETTING_JSON`` -> one JSON line on stdout."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m cepe.bench.runner CONFIG_JSON SETTING_JSON", file=sys.stderr)
        return 2
    cfg = BenchConfig.from_dict(json.loads(argv[0])).resolved()
    result = run_setting(cfg, json.loads(argv[1]))
    print(RESULT_TAG + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
