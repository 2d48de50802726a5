"""The lm-evaluation-harness ``cepe`` model on a tiny random model: registry, the three request types,
local perplexity and multiple-choice tasks, and agreement with ``cepe eval lm``."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("cepe.modeling")

from cepe.eval import harness  # noqa: E402
from cepe.eval.cli import load_setup, run_task  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()
DOCS = [
    " ".join(f"{WORDS[(i + j) % 8]} {WORDS[(i * j) % 8]} {j}." for j in range(12 + 3 * i)) for i in range(3)
]


@pytest.fixture(scope="module")
def setup():
    s = load_setup("tiny", ["cepe", "truncated", "full"], progress=False)
    torch.manual_seed(1)
    with torch.no_grad():  # a non-zero cross-attention output, so the encoder changes the predictions
        for n, p in s.cepe_model.named_parameters():
            if "cross_attn.o_proj" in n:
                p.normal_(0, 0.3)
    return s


def _inst(*args):
    return SimpleNamespace(args=args)


def _lm(setup, **kw):
    return harness.CepeLM(setup=setup, **{"decoder_window": 48, "rolling_tokens": 16, **kw})


def test_registered():
    from lm_eval.api.registry import get_model

    assert get_model("cepe") is harness.CepeLM


def test_loglikelihood_matches_a_plain_forward(setup):
    lm = _lm(setup, method="full")
    ctx, cont = DOCS[0][:100].rstrip(), DOCS[0][len(DOCS[0][:100].rstrip()) :][:30]
    (ll, greedy), (ll_empty, _) = lm.loglikelihood([_inst(ctx, cont), _inst("", cont)])
    for prefix, got in ((setup.encode(ctx), ll), ([setup.start_id], ll_empty)):
        ids = torch.tensor([prefix + setup.encode(cont)])
        logp = torch.log_softmax(setup.decoder(input_ids=ids).logits[0, :-1].float(), -1)
        n = len(setup.encode(cont))
        tgt = ids[0, -n:]
        ref = logp[-n:].gather(-1, tgt[:, None]).sum()
        assert got == pytest.approx(float(ref), abs=1e-4)
    assert greedy == bool((logp[-n:].argmax(-1) == tgt).all())
    # trailing spaces of the context move to the continuation
    assert lm._encode_pair("abc ", "def") == (setup.encode("abc"), setup.encode(" def"))


def test_loglikelihood_uses_the_encoder_beyond_the_window(setup):
    ctx, cont = DOCS[2][:200], DOCS[2][200:220]
    cepe = _lm(setup, method="cepe").loglikelihood([_inst(ctx, cont)])[0][0]
    trunc = _lm(setup, method="truncated").loglikelihood([_inst(ctx, cont)])[0][0]
    short = _lm(setup, method="cepe").loglikelihood([_inst(ctx[-28:], cont)])[0][0]
    assert cepe != pytest.approx(trunc, abs=1e-4)  # the text before the window reaches the model
    assert short == pytest.approx(
        _lm(setup, method="truncated").loglikelihood([_inst(ctx[-28:], cont)])[0][0], abs=1e-5
    )  # within the window there is nothing for the encoder


def test_rolling_agrees_with_cepe_eval_lm(setup):
    """Each rolling block ending at token e is `cepe eval lm` on the document's first e tokens."""
    lm = _lm(setup, method="cepe")
    text = DOCS[2]
    toks = setup.encode(text)
    n, E = len(toks), lm.rolling_tokens
    reqs = lm.rolling_requests(text)
    assert sum(r.num_targets for r in reqs) == n
    got = lm.loglikelihood_rolling([_inst(text)])[0]
    expected = 0.0
    for e in range(n, 0, -E):
        if e - E <= 0:  # first block: predicted from the prefix token
            lp = setup.method("cepe").score(
                [harness.window_request("cepe", [setup.start_id, *toks[:e]], 48, e, 64)]
            )
            expected += float(lp[0].sum())
            continue
        cfg = {
            "sources": [{"name": "doc", "documents": [{"id": "d", "text": text[:e]}]}],
            "totals": [e],
            "decoder_window": 48,
            "decoder_window_overrides": {},
            "eval_tokens": E,
            "chunk_length": 64,
            "sequences_per_domain": 1,
        }
        row = next(r for r in run_task("lm", setup, cfg)["rows"] if r["method"] == "cepe")
        expected -= E * math.log(row["value"])
    assert got == pytest.approx(expected, rel=1e-5)


def test_generate_until(setup):
    lm = _lm(setup, method="cepe", max_gen_toks=12)
    ctx = DOCS[1][:150]
    free, stopped = lm.generate_until([_inst(ctx, {"until": []}), _inst(ctx, {"until": ["\x00"]})])
    assert free == stopped
    stop = free[3] if len(free) > 3 else None
    if stop:
        cut = lm.generate_until([_inst(ctx, {"until": [stop], "max_gen_toks": 12})])[0]
        assert cut == free[: free.index(stop)]
    ids = setup.encode(ctx)
    req = harness.window_request("cepe", ids, 48, 0, 64)
    req.max_new_tokens = 12
    assert req.context and free == setup.decode(setup.method("cepe").generate(req))
    with pytest.raises(ValueError, match="greedy"):
        lm.generate_until([_inst(ctx, {"do_sample": True, "temperature": 1.0})])


def test_local_tasks_and_cli(setup, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    mc = [(f"Story {i}: " + DOCS[i % 3][:150], i % 2) for i in range(4)]
    files = harness.write_local_tasks(tmp_path / "tasks", DOCS, mc, ["alpha", "beta"])
    assert set(files) == {"cepe_ppl", "cepe_mc"}
    lm = _lm(setup, method="cepe")
    res = lm_eval.simple_evaluate(
        model=lm,
        tasks=["cepe_ppl", "cepe_mc"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
    )["results"]
    lls = lm.loglikelihood_rolling([_inst(d) for d in DOCS])
    nbytes = sum(len(d.encode()) for d in DOCS)
    assert res["cepe_ppl"]["byte_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / nbytes), rel=1e-6)
    # multiple choice: the harness's accuracy is the argmax of our loglikelihoods
    scores = lm.loglikelihood([_inst(t + "\nTopic:", " " + c) for t, _ in mc for c in ("alpha", "beta")])
    acc = sum(int(scores[2 * i][0] < scores[2 * i + 1][0]) == y for i, (_, y) in enumerate(mc)) / len(mc)
    assert res["cepe_mc"]["acc,none"] == pytest.approx(acc)
    # the command line: python -m cepe.eval.harness --model cepe ...
    out = tmp_path / "out"
    harness.main(
        [
            "--model",
            "cepe",
            "--model_args",
            "model=tiny,method=truncated,decoder_window=48,rolling_tokens=16",
            "--include_path",
            str(tmp_path / "tasks"),
            "--tasks",
            "cepe_ppl",
            "--output_path",
            str(out),
        ]
    )
    found = list(out.rglob("results*.json"))
    assert found and "cepe_ppl" in json.loads(found[0].read_text())["results"]


def test_bad_args(setup):
    with pytest.raises(ValueError, match="not supported"):
        harness.CepeLM(setup=setup, method="replug")
    with pytest.raises(ValueError, match="rolling_tokens"):
        harness.CepeLM(setup=setup, decoder_window=16, rolling_tokens=16)
    with pytest.raises(ValueError, match="no chat template"):
        _lm(setup).apply_chat_template([{"role": "user", "content": "hi"}])
