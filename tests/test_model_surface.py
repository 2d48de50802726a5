"""The model's public surface: copies, dtypes, the labels path, context batches, beams and samples,
precomputed states, left padding, gradient checkpointing, config ownership, GGUF decoders, more families.

Every test here failed on the code before the behaviour it checks was fixed or first tested.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM
from cepe.wrapping import FAMILIES, DecoderFamily, decoder_layers, register_family


def _ids(b=2, t=11, seed=3):
    return torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, enc_ids, enc_mask, **kw):
    with torch.no_grad():
        return model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, **kw).logits


# ----------------------------------------------------------------------------- copies
def test_deepcopy_reads_its_own_context_and_weights(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    ref = _logits(tiny_model, ids, enc_ids, enc_mask)
    plain = tiny_model(ids).logits.detach()
    twin = copy.deepcopy(tiny_model)
    # The copy uses its context (the hooks read the copy's slot, not the original's).
    torch.testing.assert_close(_logits(twin, ids, enc_ids, enc_mask), ref, rtol=0, atol=0)
    assert (ref - plain).abs().max() > 1e-3
    # ... and its own cross-attention weights: changing them changes the copy only.
    with torch.no_grad():
        for m in twin.cross_attention_modules():
            m.o_proj.weight.mul_(-1.0)
    moved = _logits(twin, ids, enc_ids, enc_mask)
    assert (moved - ref).abs().max() > 1e-3
    torch.testing.assert_close(_logits(tiny_model, ids, enc_ids, enc_mask), ref, rtol=0, atol=0)
    # A context installed on the original does not leak into the copy.
    ctx = tiny_model.prepare_context(enc_ids, enc_mask)
    with tiny_model.use_context(ctx), torch.no_grad():
        assert torch.equal(twin(ids).logits, plain)


def test_caller_config_is_not_mutated():
    cfg = tiny_cepe_config()
    before = dataclasses.asdict(cfg)
    model = CepeForCausalLM.from_decoder(tiny_decoder(), cfg)
    CepeForCausalLM(tiny_decoder(), cfg)
    assert dataclasses.asdict(cfg) == before
    assert cfg.decoder_vocab_size is None and model.cepe_config.decoder_vocab_size == VOCAB
    assert model.cepe_config is not cfg


# ----------------------------------------------------------------------------- dtype
def test_from_pretrained_dtype_casts_every_part(tmp_path):
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    randomize_cross(model)
    model.save_pretrained(tmp_path / "a")
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    ref = _logits(model, ids, enc_ids, enc_mask)
    bf = CepeForCausalLM.from_pretrained(tmp_path / "a", decoder=tiny_decoder(), dtype=torch.bfloat16).eval()
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    out = _logits(bf, ids, enc_ids, enc_mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()  # bf16 rounding, same function
    # Without a dtype nothing is cast: the decoder as given, the encoder fp32.
    kept = CepeForCausalLM.from_pretrained(tmp_path / "a", decoder=tiny_decoder().to(torch.bfloat16))
    assert kept.dtype == torch.bfloat16 and next(kept.encoder.parameters()).dtype == torch.float32


def test_released_layout_follows_the_same_dtype_rule(tmp_path):
    from test_checkpoints import _write_official

    path, _, _ = _write_official(tmp_path, "safetensors")
    bf = CepeForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    given = tiny_decoder(seed=5).to(torch.bfloat16)
    kept = CepeForCausalLM.from_pretrained(path, decoder=given)
    assert kept.dtype == torch.bfloat16  # the given decoder is not silently cast to fp32
    assert next(kept.encoder.parameters()).dtype == torch.float32


# ----------------------------------------------------------------------------- labels path
def test_labels_path_returns_logits_and_honours_logits_to_keep(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    full = _logits(tiny_model, ids, enc_ids, enc_mask)
    with torch.no_grad():
        out = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids)
        last = tiny_model(
            ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids, logits_to_keep=1
        )
        none = tiny_model(
            ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids, return_logits=False
        )
    assert out.logits is not None and out.logits.shape == full.shape
    torch.testing.assert_close(out.logits, full, rtol=1e-5, atol=1e-5)
    assert last.logits.shape == (2, 1, VOCAB)
    torch.testing.assert_close(last.logits, full[:, -1:], rtol=1e-5, atol=1e-5)
    assert last.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)  # the loss covers every position
    assert none.logits is None and none.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)


def test_labels_path_without_supervised_tokens_is_zero_not_nan(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    labels = torch.full_like(ids, -100)
    tiny_model.train()
    out = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=labels)
    assert out.loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in tiny_model.trainable_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and g.abs().max() == 0 for g in grads)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_labels_path_applies_logit_soft_capping(family):
    dec = tiny_decoder(family, final_logit_softcapping=0.1)  # small cap: capping changes the logits
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config()).eval()
    randomize_cross(model)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        logits = _logits(model, ids, enc_ids, enc_mask)  # the decoder's own forward caps
        out = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids)
        uncapped = model.decoder.get_output_embeddings()(model.decoder.get_decoder()(ids).last_hidden_state)
    assert logits.abs().max() <= 0.1 and (torch.tanh(uncapped / 0.1) * 0.1 - uncapped).abs().max() > 0.01
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- context batches
def test_mismatched_context_batch_is_an_error(tiny_model):
    enc_ids, enc_mask = random_context(2, 3)
    with pytest.raises(ValueError, match="decoder batch has 4 rows but the context 2"):
        tiny_model(_ids(4), encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)
    with pytest.raises(ValueError, match="decoder batch has 2 rows but the context 1"):
        tiny_model(_ids(2), encoder_input_ids=enc_ids[:1], encoder_attention_mask=enc_mask[:1])
    with pytest.raises(ValueError, match="decoder batch has 2 rows but the context 1"):
        tiny_model.generate(
            _ids(2), encoder_input_ids=enc_ids[:1], encoder_attention_mask=enc_mask[:1], max_new_tokens=1
        )
    ctx = tiny_model.prepare_context(enc_ids, enc_mask)
    with pytest.raises(ValueError, match="rows but the context 2"), tiny_model.use_context(ctx):
        tiny_model.decoder(_ids(4))  # a decoder call inside use_context is checked too


def _per_example(model, ids, enc_ids, enc_mask, **kw):
    return [
        model.generate(
            ids[i : i + 1],
            encoder_input_ids=enc_ids[i : i + 1],
            encoder_attention_mask=enc_mask[i : i + 1],
            **kw,
        )
        for i in range(ids.shape[0])
    ]


def test_beam_search_with_context_equals_each_example_alone(tiny_model):
    ids = _ids(2, 6)
    enc_ids, enc_mask = random_context(2, 3, seed=5)
    kw = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    both = tiny_model.generate(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, **kw)
    alone = _per_example(tiny_model, ids, enc_ids, enc_mask, **kw)
    assert both.shape[0] == 4
    assert torch.equal(both[:2], alone[0]) and torch.equal(both[2:], alone[1])
    # the context matters to the beams (else the check above would hold trivially)
    plain = tiny_model.generate(ids, **kw)
    assert not torch.equal(plain, both)


def test_several_samples_with_context_read_their_own_example(tiny_model):
    ids = _ids(2, 6)
    enc_ids, enc_mask = random_context(2, 3, seed=5)
    greedy = _per_example(
        tiny_model, ids, enc_ids, enc_mask, max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    torch.manual_seed(0)
    samples = tiny_model.generate(
        ids,
        encoder_input_ids=enc_ids,
        encoder_attention_mask=enc_mask,
        max_new_tokens=5,
        do_sample=True,
        top_k=1,  # sampling that is deterministic: every sample is that example's greedy answer
        num_return_sequences=3,
        pad_token_id=0,
    )
    assert samples.shape[0] == 6
    for i in range(2):
        for j in range(3):
            assert torch.equal(samples[3 * i + j], greedy[i][0])


def test_encoder_hidden_states_input_equals_encoder_input_ids(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 2, 4:] = False
    ref = _logits(tiny_model, ids, enc_ids, enc_mask)
    with torch.no_grad():
        states, key_mask = tiny_model.encode_context(enc_ids, enc_mask)
        a = tiny_model(ids, encoder_hidden_states=states, encoder_attention_mask=key_mask).logits
        b = tiny_model(ids, encoder_hidden_states=states, encoder_attention_mask=enc_mask).logits
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        tiny_model(ids, encoder_hidden_states=states, encoder_input_ids=enc_ids)
    with pytest.raises(ValueError, match="encoder_hidden_states must be"):
        tiny_model(ids, encoder_hidden_states=states[..., :5])


def test_a_mixture_takes_token_ids_next_to_precomputed_states(tiny_model):
    """With the output mixture's suffix match, ``encoder_input_ids`` next to ``encoder_hidden_states`` are
    the states' token ids: the logits are those of encoding the ids; the wrong number of ids is refused."""
    tiny_model.enable_output_mix(3, hidden=False)
    with torch.no_grad():  # weights on the match indicators: the ids change the logits
        tiny_model.mix_head.weight.copy_(torch.tensor([[2.0, -1.5, 3.0]]))
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 2, 4:] = False
    ids[:, :2] = enc_ids[:, 0, :2]  # the decoder's first tokens occur in the context: the match counts
    ref = _logits(tiny_model, ids, enc_ids, enc_mask)
    with torch.no_grad():
        states, key_mask = tiny_model.encode_context(enc_ids, enc_mask)
        got = tiny_model(
            ids, encoder_hidden_states=states, encoder_attention_mask=key_mask, encoder_input_ids=enc_ids
        ).logits
        flat = tiny_model(
            ids,
            encoder_hidden_states=states,
            encoder_attention_mask=key_mask,
            encoder_input_ids=enc_ids.reshape(2, -1),
        ).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        other = tiny_model(
            ids, encoder_hidden_states=states, encoder_attention_mask=key_mask, encoder_input_ids=enc_ids + 1
        ).logits
    assert (other - ref).abs().max() > 1e-3  # the ids are read, not ignored
    with pytest.raises(ValueError, match="one token id per position"):
        tiny_model(ids, encoder_hidden_states=states, encoder_input_ids=enc_ids[:, :2])
    with pytest.raises(ValueError, match="need the context's token ids"):
        tiny_model(ids, encoder_hidden_states=states, encoder_attention_mask=key_mask)


def test_left_padded_batch_with_contexts_equals_each_example_alone(tiny_model):
    long, short = _ids(1, 9, seed=7), _ids(1, 5, seed=8)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    enc_ids, enc_mask = random_context(2, 3, seed=9)
    enc_mask[1, 1:] = False
    kw = dict(
        max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    both = tiny_model.generate(
        ids, attention_mask=mask, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, **kw
    )
    for i, prompt in enumerate((long, short)):
        alone = tiny_model.generate(
            prompt, encoder_input_ids=enc_ids[i : i + 1], encoder_attention_mask=enc_mask[i : i + 1], **kw
        )
        assert torch.equal(both.sequences[i, -6:], alone.sequences[0, -6:])
        torch.testing.assert_close(
            torch.stack([s[i] for s in both.scores]),
            torch.stack([s[0] for s in alone.scores]),
            rtol=1e-4,
            atol=1e-4,
        )


# ----------------------------------------------------------------------------- gradient checkpointing
def test_kv_cache_mode_under_gradient_checkpointing_gives_the_plain_gradients():
    """With the default ``kv`` cache, a checkpointed decoder gets the gradients of an unchecked one: K/V
    cached in the first pass are not reused by the recomputation in backward."""

    def grads(checkpoint: bool):
        model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(cross_attention_cache="kv"))
        randomize_cross(model)
        model.train()
        if checkpoint:
            model.decoder.activation_checkpointing_enable({"use_reentrant": False})
            model.decoder.train()  # HF checkpoints only layers in training mode (no dropout in Llama)
        ids = _ids()
        enc_ids, enc_mask = random_context(2, 3)
        ctx = model.prepare_context(enc_ids, enc_mask)
        with model.use_context(ctx):  # installed until backward has recomputed the layers
            loss = model(ids, cross_context=ctx, labels=ids).loss
            loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss_a, plain = grads(False)
    loss_b, ckpt = grads(True)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert set(plain) == set(ckpt)
    for n, g in plain.items():
        assert g is not None and ckpt[n] is not None, n
        torch.testing.assert_close(ckpt[n], g, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_without_a_held_context_is_a_clear_error():
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).train()
    model.decoder.activation_checkpointing_enable()
    model.decoder.train()
    enc_ids, enc_mask = random_context(2, 3)
    with pytest.raises(ValueError, match="context must stay installed"):
        model(_ids(), encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=_ids())
    with torch.no_grad():  # nothing is recomputed without autograd
        model(_ids(), encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)
    model.decoder.activation_checkpointing_enable({"use_reentrant": True})
    ctx = model.prepare_context(enc_ids, enc_mask)
    with pytest.raises(ValueError, match="reentrant gradient checkpointing"), model.use_context(ctx):
        model(_ids(), cross_context=ctx, labels=_ids())


# ----------------------------------------------------------------------------- families
@pytest.mark.parametrize("family", ["mixtral", "gemma"])
def test_more_families_keep_the_invariants(family):
    kw = {"head_dim": 16} if family == "gemma" else {}
    dec = tiny_decoder(family, **kw)
    ids = _ids()
    with torch.no_grad():
        ref = dec(ids).logits
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config(pack_keys=False)).eval()
    randomize_cross(model)
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[0, 2, 3:] = False
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    from test_model import _reference_layer_check

    _reference_layer_check(model, ids, enc_ids, enc_mask, gemma=False)


def test_register_family(monkeypatch):
    dec = tiny_decoder()
    dec.config.model_type = "my_llama"
    with pytest.raises(ValueError, match="'my_llama' is not registered"):
        CepeForCausalLM.from_decoder(dec, tiny_cepe_config())
    monkeypatch.setitem(FAMILIES, "my_llama", FAMILIES["llama"])  # restored after the test
    register_family("my_llama", DecoderFamily())
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config()).eval()
    randomize_cross(model)
    assert all(hasattr(lay, "cross_attn") for lay in decoder_layers(model.decoder))
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        ref = tiny_decoder()(ids).logits
        assert torch.equal(model(ids).logits, ref)
    assert (_logits(model, ids, enc_ids, enc_mask) - ref).abs().max() > 1e-3


# ----------------------------------------------------------------------------- GGUF decoders
@pytest.mark.slow
def test_gguf_decoder_is_recorded_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    from cepe import EncoderConfig
    from cepe.assets import default_decoder_gguf

    gguf_dir, gguf_name = default_decoder_gguf()
    dec = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name).eval()
    vocab = int(dec.config.vocab_size)
    enc = EncoderConfig(vocab_size=vocab + 1, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config(encoder=enc, num_cross_attn_layers=2)).eval()
    assert model.cepe_config.decoder_name_or_path == str(gguf_dir / gguf_name)
    model.save_pretrained(tmp_path / "a")
    loaded = CepeForCausalLM.from_pretrained(tmp_path / "a").eval()  # the decoder from the recorded file
    ids = torch.randint(0, 1000, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_left_padded_batch_generates_each_row_as_alone(tiny_model):
    """The plain model: left padding changes no row (the read-state options check the same)."""
    from conftest import check_left_padded_generation

    check_left_padded_generation(tiny_model)
