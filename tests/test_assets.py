"""cepe.assets: the one-time conversion of the packaged default decoder is safe when two processes start it
at once (stages trained together on one machine): the one that finishes second keeps the first one's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import transformers

import cepe.assets as assets
from cepe.assets import (
    default_decoder_dir as convert_default,
)  # the real one: quick tests replace the module's


def test_a_conversion_that_loses_the_race_keeps_the_winners(tmp_path, monkeypatch):
    monkeypatch.setenv("CEPE_CACHE", str(tmp_path))
    monkeypatch.setattr(assets, "default_decoder_gguf", lambda: (tmp_path, "model.gguf"))
    target = tmp_path / "decoders" / assets.DEFAULT_DECODER

    class Converted:  # stands in for the dequantised GGUF model
        hf_quantizer = None
        config = SimpleNamespace()

        def save_pretrained(self, d):
            (d / "config.json").write_text("{}")
            # meanwhile another process finishes its own conversion
            target.mkdir(parents=True)
            (target / "config.json").write_text(json.dumps({"winner": 1}))

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Converted())
    tok = SimpleNamespace(save_pretrained=lambda d: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    assert convert_default() == target
    assert json.loads((target / "config.json").read_text()) == {"winner": 1}
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary directory left
    assert convert_default() == target  # converted: nothing to do
