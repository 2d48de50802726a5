"""Shared tiny random models for the tests (CPU, seconds)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from cepe import CepeConfig, CepeForCausalLM, EncoderConfig
from cepe.tiny import random_decoder

VOCAB = 97


@pytest.fixture(autouse=True)
def _markers_say_what_a_test_does(request, monkeypatch):
    """``slow`` and ``multiproc`` are enforced, so ``-m "not slow and not multiproc"`` (the quick tier of
    ``scripts/test.sh``) really leaves out every test that loads the real default decoder or starts other
    Python processes: an unmarked test that does either fails and says which marker it needs."""
    if request.node.get_closest_marker("slow") is None:
        import cepe.assets

        def refuse(*args, **kwargs):
            raise RuntimeError("this test loads the real default decoder: mark it @pytest.mark.slow")

        monkeypatch.setattr(cepe.assets, "default_decoder_dir", refuse)
        monkeypatch.setattr(cepe.assets, "default_decoder_gguf", refuse)
    if request.node.get_closest_marker("multiproc") is None:
        monkeypatch.setattr(subprocess, "Popen", _NoPythonPopen)


class _NoPythonPopen(subprocess.Popen):
    """``subprocess.Popen`` that refuses to start the Python interpreter (other programs run)."""

    def __init__(self, args, *rest, **kwargs):
        program = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        if os.path.realpath(str(program)) == os.path.realpath(sys.executable):
            raise RuntimeError("this test starts Python processes: mark it @pytest.mark.multiproc")
        super().__init__(args, *rest, **kwargs)


def tiny_decoder(family: str = "llama", seed: int = 0, **overrides):
    """A 3-layer random decoder of the given family (fp32, eval mode), built by :func:`cepe.tiny.random_decoder`."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family in ("gemma2", "gemma3_text", "qwen3"):
        kw["head_dim"] = 16
    kw.update(overrides)
    return random_decoder(family, seed, **kw)


def tiny_cepe_config(**overrides) -> CepeConfig:
    enc = EncoderConfig(
        vocab_size=VOCAB + 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mask_token_id=VOCAB
    )
    kw = dict(encoder=enc, chunk_length=8)
    kw.update(overrides)
    return CepeConfig(**kw)


def randomize_cross(model: CepeForCausalLM, seed: int = 1, std: float = 0.2) -> None:
    """Give every cross-attention non-trivial weights (o_proj is zero after init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))


def heads_scaled(m, hidden: torch.Tensor, ctx, strength: torch.Tensor) -> torch.Tensor:
    """A cross-attention layer's update with head h's output times ``strength[..., h]`` ``(B, T, H)``, made
    by hand: ``o_proj`` is linear, so the layer (its gates removed by the caller) runs one head at a time."""
    w = m.o_proj.weight.clone()
    hd = m.head_dim
    out = 0
    with torch.no_grad():
        for h in range(m.num_heads):
            m.o_proj.weight.zero_()
            m.o_proj.weight[:, h * hd : (h + 1) * hd] = w[:, h * hd : (h + 1) * hd]
            out = out + m(hidden, ctx) * strength[..., h : h + 1]
        m.o_proj.weight.copy_(w)
    return out


@pytest.fixture
def tiny_model() -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    randomize_cross(model)
    return model


def random_context(b: int, k: int, length: int = 8, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, k, length), generator=g)
    mask = torch.ones(b, k, length, dtype=torch.bool)
    return ids, mask


def load_script(name: str):
    """The module of ``scripts/<name>.py`` (scripts are not a package), with ``scripts/`` on the path as
    when the script is run, so that it can import its neighbours."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    if scripts not in sys.path:
        sys.path.append(scripts)
    path = os.path.join(scripts, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ids_of(b: int = 2, t: int = 9, seed: int = 5) -> torch.Tensor:
    """``(B, T)`` random decoder token ids."""
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def check_read_state_options(model: CepeForCausalLM, switch_off) -> None:
    """Invariants of an option that tracks where heads read (induction gates, run biases), on ``model``
    whose option weights are non-zero: no context is exactly the decoder; the option acts (``switch_off``
    zeroes its weights and the logits change); with every ``o_proj`` zero the model is the decoder."""
    ids = ids_of()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        on = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert torch.equal(model(ids).logits, tiny_decoder()(ids).logits)  # no context: the decoder
        for m in model.cross_attention_modules():
            switch_off(m)
        off = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert (on - off).abs().max().item() > 1e-3  # the option acts
        for m in model.cross_attention_modules():
            m.o_proj.weight.zero_()
        assert torch.equal(
            model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits,
            tiny_decoder()(ids).logits,
        )


def check_incremental_calls(
    model: CepeForCausalLM, mode: str, ids: torch.Tensor | None = None, enc_ids: torch.Tensor | None = None
) -> None:
    """A prompt then one token at a time (each call carries on from where the last ended) gives the
    logits of one call over the whole sequence; a fresh call on the same context starts over. ``ids``
    ``(2, 10)`` and ``enc_ids`` ``(2, 3, 8)``: other decoder tokens and context than the random ones."""
    import inspect

    ids = ids_of(t=10) if ids is None else ids
    enc_ids, enc_mask = (
        random_context(2, 3) if enc_ids is None else (enc_ids, torch.ones_like(enc_ids).bool())
    )
    enc_mask[1, 2] = False
    with torch.no_grad():
        ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache=mode)
        whole = model(ids, cross_context=ctx).logits
        ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache=mode)
        out = model(ids[:, :4], cross_context=ctx, use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        name = (
            "cache" if "cache" in inspect.signature(model.decoder.forward).parameters else "past_key_values"
        )
        for t in range(4, 10):
            out = model(ids[:, t : t + 1], cross_context=ctx, use_cache=True, **{name: cache})
            steps.append(out.logits)
            cache = out.past_key_values
        again = model(ids, cross_context=ctx).logits  # state left by the steps is not used
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, whole)


def check_beam_scores(model: CepeForCausalLM) -> None:
    """Each returned beam's score (length_penalty 0: the sum of its tokens' log-probabilities) is what a
    single call over that sequence gives: per-row read state was reordered with the beams."""
    ids = ids_of(b=1, t=5)
    enc_ids, enc_mask = random_context(1, 3)
    out = model.generate(
        ids,
        encoder_input_ids=enc_ids,
        encoder_attention_mask=enc_mask,
        max_new_tokens=6,
        num_beams=4,
        num_return_sequences=4,
        length_penalty=0.0,
        do_sample=False,
        early_stopping=True,
        pad_token_id=0,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert "_reorder_cache" not in model.decoder.__dict__  # removed after the call
    seqs = out.sequences
    with torch.no_grad():
        ctx = model.prepare_context(enc_ids.expand(4, -1, -1), enc_mask.expand(4, -1, -1))
        logp = model(seqs, cross_context=ctx).logits.float().log_softmax(-1)
    want = logp[:, 4:-1].gather(-1, seqs[:, 5:, None])[..., 0].sum(-1)
    torch.testing.assert_close(out.sequences_scores, want, rtol=1e-4, atol=1e-4)


def check_left_padded_generation(
    model: CepeForCausalLM,
    ids: torch.Tensor | None = None,
    enc_ids: torch.Tensor | None = None,
    pad_id: int = 1,
    pads: int = 3,
    cache: str | None = None,
) -> None:
    """Prompts of different lengths generated in one left-padded batch give each row what it gives alone
    (the same tokens, the same scores at every step): the padding columns enter nothing a row reads (where
    its heads read last, the output mixture's suffix matches); a forward over the padded batch (positions
    counted from each row's first token) gives each row's logits. ``ids`` ``(2, T)``: the first row is
    generated whole, the second without its first ``pads`` tokens (``pad_id`` columns in the batch);
    ``enc_ids`` ``(2, K, L)``: other tokens than the random ones (pad ids among them, so that a pad column
    could match). ``cache``: generate's ``cache_implementation`` (``"static"``: the decoder builds a 4-D
    mask, and the padding is known from the prompt's mask alone)."""
    ids = ids_of(t=8) if ids is None else ids
    enc_ids = random_context(2, 3)[0] if enc_ids is None else enc_ids
    enc_mask = torch.ones_like(enc_ids).bool()
    batch = ids.clone()
    batch[1, :pads] = pad_id
    attn = torch.ones_like(batch)
    attn[1, :pads] = 0
    ctx_kw = dict(encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)
    with torch.no_grad():
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        logits = model(batch, attention_mask=attn, position_ids=pos, **ctx_kw).logits
        for row, start in ((0, 0), (1, pads)):
            alone = model(
                ids[row : row + 1, start:], **{k: v[row : row + 1] for k, v in ctx_kw.items()}
            ).logits
            torch.testing.assert_close(logits[row, start:], alone[0], rtol=1e-4, atol=1e-4)
    kw = dict(
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
        **({} if cache is None else {"cache_implementation": cache}),
    )
    out = model.generate(
        batch, attention_mask=attn, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, **kw
    )
    for row, prompt in ((0, ids[0:1]), (1, ids[1:2, pads:])):
        alone = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            encoder_input_ids=enc_ids[row : row + 1],
            encoder_attention_mask=enc_mask[row : row + 1],
            **kw,
        )
        assert out.sequences[row, ids.shape[1] :].tolist() == alone.sequences[0, prompt.shape[1] :].tolist()
        got = torch.stack([s[row] for s in out.scores])
        want = torch.stack([s[0] for s in alone.scores])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    beams = dict(kw, num_beams=3, num_return_sequences=2, output_scores=False, return_dict_in_generate=False)
    out = model.generate(batch, attention_mask=attn, **ctx_kw, **beams)  # (2 rows x 2 beams, T + new)
    for row, prompt in ((0, ids[0:1]), (1, ids[1:2, pads:])):
        alone = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            **{k: v[row : row + 1] for k, v in ctx_kw.items()},
            **beams,
        )
        assert out[2 * row : 2 * row + 2, ids.shape[1] :].tolist() == alone[:, prompt.shape[1] :].tolist()


def check_checkpointing_gradients(make_model) -> dict[str, torch.Tensor]:
    """The loss and every gradient of a fresh ``make_model()`` with and without gradient checkpointing
    agree (statistics computed without gradient are reused in the recomputation); returns the gradients."""

    def grads(checkpoint: bool):
        model = make_model().train()
        if checkpoint:
            model.decoder.activation_checkpointing_enable({"use_reentrant": False})
            model.decoder.train()
        enc_ids, enc_mask = random_context(2, 3)
        ctx = model.prepare_context(enc_ids, enc_mask)
        with model.use_context(ctx):
            loss = model(ids_of(), cross_context=ctx, labels=ids_of(seed=6)).loss
            loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss_a, plain = grads(False)
    loss_b, ckpt = grads(True)
    assert loss_a == pytest.approx(loss_b, rel=1e-6) and set(plain) == set(ckpt)
    for n, g in plain.items():
        torch.testing.assert_close(ckpt[n], g, rtol=1e-4, atol=1e-6)
    return plain


def check_enabling_keeps_the_function(plain: CepeForCausalLM, enable, option: str) -> None:
    """``enable()`` adds an option's zero weights to ``plain`` (an adapter without them): the config says
    so and the logits stay bit-identical."""
    ids = ids_of()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        before = plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        enable()
        assert getattr(plain.cepe_config, option)
        assert torch.equal(
            before, plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        )


def check_saved_option(model: CepeForCausalLM, option: str, path) -> None:
    """``model`` saves and loads with its per-layer ``option`` weights (and the config's flag) intact."""
    model.save_pretrained(path)
    loaded = CepeForCausalLM.from_pretrained(path, decoder=tiny_decoder()).eval()
    assert getattr(loaded.cepe_config, option)
    for a, b in zip(model.cross_attention_modules(), loaded.cross_attention_modules()):
        assert torch.equal(getattr(a, option), getattr(b, option))
