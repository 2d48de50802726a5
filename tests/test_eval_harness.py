"""The lm-evaluation-harness ``cepe`` model on a tiny random model: registry, the three request types,
local perplexity and multiple-choice tasks, and agreement with ``cepe eval lm``."""

import importlib.metadata as md
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("cepe.modeling")

from cepe.eval import harness  # noqa: E402
from cepe.eval.api import load_setup, run_task  # noqa: E402

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


def _cepe_eval_lm_loglik(setup, text, window=48, E=16):
    """The document's log-likelihood from `cepe eval lm`: the block ending at token e (every E tokens
    back from the end) is `cepe eval lm` on the document's first e tokens; the first block is predicted
    from the prefix token."""
    toks = setup.encode(text)
    total = 0.0
    for e in range(len(toks), 0, -E):
        if e - E <= 0:
            lp = setup.method("cepe").score(
                [harness.window_request("cepe", [setup.start_id, *toks[:e]], window, e, 64)]
            )
            total += float(lp[0].sum())
            continue
        cfg = {
            "sources": [{"name": "doc", "documents": [{"id": "d", "text": text[:e]}]}],
            "totals": [e],
            "decoder_window": window,
            "decoder_window_overrides": {},
            "eval_tokens": E,
            "chunk_length": 64,
            "sequences_per_domain": 1,
        }
        row = next(r for r in run_task("lm", setup, cfg)["rows"] if r["method"] == "cepe")
        total -= E * math.log(row["value"])
    return total


def test_rolling_agrees_with_cepe_eval_lm(setup):
    """Each rolling block ending at token e is `cepe eval lm` on the document's first e tokens."""
    lm = _lm(setup, method="cepe")
    text = DOCS[2]
    reqs = lm.rolling_requests(text)
    assert sum(r.num_targets for r in reqs) == len(setup.encode(text))
    got = lm.loglikelihood_rolling([_inst(text)])[0]
    assert got == pytest.approx(_cepe_eval_lm_loglik(setup, text, 48, lm.rolling_tokens), rel=1e-5)


def test_generate_until(setup):
    lm = _lm(setup, method="cepe", max_gen_toks=12)
    ctx = DOCS[1][:150]
    free, stopped = lm.generate_until([_inst(ctx, {"until": []}), _inst(ctx, {"until": ["\x00"]})])
    assert free == stopped
    stop = free[3] if len(free) > 3 else None
    if stop:
        cut = lm.generate_until([_inst(ctx, {"until": [stop], "max_gen_toks": 12})])[0]
        assert cut == free[: free.index(stop)]
    # a stop string that is one token ends generation at that token (the text is the same as cutting)
    one = next(
        (c for c in free[1:] if len(setup.encode(c)) == 1 and setup.decode(setup.encode(c)) == c), None
    )
    if one:
        made = []  # the tokens each generation made
        real = lm.method.generate
        lm.method.generate = lambda req, **kw: made.append(real(req, **kw)) or made[-1]
        try:
            cut = lm.generate_until([_inst(ctx, {"until": [one], "max_gen_toks": 12})])[0]
        finally:
            del lm.method.generate
        assert cut == free[: free.index(one)] and setup.decode(made[0]) == cut and len(made[0]) < 12
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
    # the command line in this process: cepe-lm-eval --model cepe ... (harness_cli.main)
    from cepe.eval.harness_cli import main as harness_main

    out = tmp_path / "out"
    harness_main(
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
    with pytest.raises(ValueError, match=r"unknown model_args \['decoder_windw'\]"):
        harness.CepeLM(setup=setup, decoder_windw=48)
    harness.CepeLM(setup=setup, decoder_window=48, max_batch_size=4)  # what the harness adds: accepted


ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_entry_point_names_the_registered_class():
    """lm-eval registers an installed `lm_eval.models` entry point as a lazy placeholder; loading it imports
    the module, whose @register_model replaces the placeholder only if both name the same class."""
    project = _pyproject()
    value = project["entry-points"]["lm_eval.models"]["cepe"]
    assert value == f"{harness.CepeLM.__module__}:{harness.CepeLM.__name__}"
    assert md.EntryPoint(name="cepe", value=value, group="lm_eval.models").load() is harness.CepeLM
    assert project["scripts"]["cepe-lm-eval"] == "cepe.eval.harness_cli:main"


def _lm_eval_reads_entry_points() -> bool:
    import lm_eval.api.registry
    import lm_eval.models

    return any(
        "entry_points(" in Path(m.__file__).read_text() for m in (lm_eval.api.registry, lm_eval.models)
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("script", ["lm_eval", "cepe-lm-eval"])
def test_command_line_matches_cepe_eval_lm(script, tmp_path):
    """`lm_eval --model cepe` (the entry point) and `cepe-lm-eval --model cepe` (the same command line with
    `cepe` registered) in a separate process: their byte perplexity on a local task is the one from
    `cepe eval lm` on the same documents."""
    bindir = Path(sys.executable).parent
    paths = [str(ROOT)]
    if script == "lm_eval":
        if not _lm_eval_reads_entry_points():
            pytest.skip(
                f"lm-eval {md.version('lm_eval')} does not read `lm_eval.models` entry points; "
                "its command line with `cepe` registered is `cepe-lm-eval` (the other case)"
            )
        # the entry points this checkout declares, as an install would record them (a stale or absent
        # install of the package must not decide the test)
        info = tmp_path / "meta" / "cepe-0.0.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cepe\nVersion: 0.0.0\n")
        eps = _pyproject()["entry-points"]["lm_eval.models"]
        (info / "entry_points.txt").write_text(
            "[lm_eval.models]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
        )
        paths.insert(0, str(info.parent))
    exe = bindir / script
    # without the installed script, what it runs (an editable install made before the script existed)
    entry = "lm_eval.__main__:cli_evaluate" if script == "lm_eval" else "cepe.eval.harness_cli:main"
    mod, fn = entry.split(":")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", f"import sys, {mod}; sys.exit({mod}.{fn}())"]
    harness.write_local_tasks(tmp_path / "tasks", DOCS, [(DOCS[0][:80], 0)], ["alpha", "beta"])
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("PYTHONSTARTUP", None)
    proc = subprocess.run(
        [
            *cmd,
            "--model",
            "cepe",
            "--model_args",
            "model=tiny,method=cepe,decoder_window=48,rolling_tokens=16",
            "--device",
            "cpu",
            "--include_path",
            str(tmp_path / "tasks"),
            "--tasks",
            "cepe_ppl",
            "--output_path",
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = list((tmp_path / "out").rglob("results*.json"))
    assert found, proc.stderr[-3000:]
    got = json.loads(found[0].read_text())["results"]["cepe_ppl"]["byte_perplexity,none"]
    setup = load_setup("tiny", ["cepe"], progress=False)  # the same model the command line loads
    ll = sum(_cepe_eval_lm_loglik(setup, d) for d in DOCS)
    assert got == pytest.approx(math.exp(-ll / sum(len(d.encode()) for d in DOCS)), rel=1e-5)
