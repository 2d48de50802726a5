"""Every ``cepe`` sub-command's flags are generated from one config dataclass (:mod:`cepe.configio`): the
parser holds one generated flag per field, its help is the field's documentation, the spellings the docs
and scripts use still parse to the same settings, and bad keys or values in a config are errors that name
the key."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from cepe.bench.config import BenchConfig, StoreBenchConfig
from cepe.cli import build_parser, main
from cepe.commands import ExportConfig, GenerateConfig, InfoConfig
from cepe.configio import FLAG_PREFIX, config_from_args, field_docs
from cepe.data.cli import config_from_cli
from cepe.data.prepare import PrepareDataConfig, prepare_data
from cepe.eval.cli import load_eval_config
from cepe.eval.config import EvalRunConfig
from cepe.main_job import MainConfig, run_main
from cepe.serve_config import AskConfig, ContextAddConfig, ServeConfig, ServeLimits, StoreConfig
from cepe.training.config import TrainConfig
from cepe.training.fit_config import HeadFitConfig

# sub-command -> (its config dataclass, fields that are not flags)
COMMANDS = {
    ("train",): (TrainConfig, {"stage"}),
    ("pretrain-encoder",): (TrainConfig, {"stage"}),
    ("teacher",): (TrainConfig, {"stage"}),
    ("fit-heads",): (HeadFitConfig, set()),
    ("bench",): (BenchConfig, set()),
    ("bench-store",): (StoreBenchConfig, set()),
    ("eval",): (EvalRunConfig, set()),
    ("prepare-data",): (PrepareDataConfig, set()),
    ("main",): (MainConfig, set()),
    ("generate",): (GenerateConfig, set()),
    ("export",): (ExportConfig, set()),
    ("info",): (InfoConfig, set()),
    ("context", "add"): (ContextAddConfig, set()),
    ("context", "list"): (StoreConfig, set()),
    ("context", "show"): (StoreConfig, {"json"}),
    ("context", "rm"): (StoreConfig, {"json"}),
    ("ask",): (AskConfig, set()),
    ("serve",): (ServeConfig, set()),
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = _subparsers(parser)
    if not subs:
        yield path, parser
    for name, sub in subs.items():
        yield from _leaf_parsers(sub, (*path, name))


def _keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted field key -> its documentation, sections flattened."""
    out = {}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            out.update(_keys(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = docs.get(f.name, "")
    return out


def test_every_subcommand_is_covered():
    assert {path for path, _ in _leaf_parsers(build_parser())} == set(COMMANDS)


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_flags_are_generated_from_the_dataclass(path):
    """One generated flag per field (a ``cfg:`` destination, read back by ``flag_overrides``), named after
    the field, and the field's documentation in ``--help``."""
    cls, skip = COMMANDS[path]
    parser = dict(_leaf_parsers(build_parser()))[path]
    generated = {}
    for action in parser._actions:
        if action.dest.startswith(FLAG_PREFIX):
            generated.setdefault(action.dest[len(FLAG_PREFIX) :], []).extend(action.option_strings)
    keys = {k: doc for k, doc in _keys(cls).items() if k.split(".")[0] not in skip}
    assert set(generated) == set(keys)
    helptext = " ".join(parser.format_help().split())
    for key, doc in keys.items():
        assert "--" + key.replace("_", "-") in generated[key]
        assert doc, f"{cls.__name__}.{key} is not documented"
        first_words = " ".join(doc.replace("``", "").split()[:3])
        assert first_words in helptext, (key, first_words)


def _args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_eval_flags_kept_and_precedence(tmp_path):
    args = _args(
        [
            "eval",
            "lm",
            "--model",
            "tiny",
            "--methods",
            "cepe,truncated",
            "--no-progress",
            "--autocast",
            "bf16",
        ]
        + ["--batch-size", "1", "--limit", "3", "--cepe-init", "--out", "o", "--dtype", "bf16"]
    )
    run, settings, options = load_eval_config("lm", args.config, args.set or [], _flags(args))
    assert run == EvalRunConfig(
        model="tiny",
        methods=["cepe", "truncated"],
        autocast="bf16",
        batch_size=1,
        limit=3,
        cepe_init=True,
        out="o",
        dtype="bf16",
        progress=False,
    )
    assert (settings, options) == ({}, {})
    assert config_from_args(EvalRunConfig, _args(["eval", "lm"])) == EvalRunConfig()  # the old defaults
    assert EvalRunConfig().methods == ["truncated"] and EvalRunConfig().out == "results/eval"
    assert _args(["eval", "lm", "--methods", "cepe", "full"]).__dict__[FLAG_PREFIX + "methods"] == [
        "cepe",
        "full",
    ]
    # the file's run: section < --set < flags; methods: and the task keys pass through
    conf = tmp_path / "lm.yaml"
    conf.write_text(
        "totals: [160]\nmethods: {streamingllm: {stride: 32}}\nrun: {methods: 'cepe,full', seed: 4, limit: 2}\n"
    )
    args = _args(["eval", "lm", "--config", str(conf), "--set", "run.seed=5", "--limit", "7"])
    run, settings, options = load_eval_config("lm", args.config, args.set, _flags(args))
    assert (run.methods, run.seed, run.limit) == (["cepe", "full"], 5, 7)
    assert settings == {"totals": [160]} and options == {"streamingllm": {"stride": 32}}


def _flags(args):
    from cepe.configio import flag_overrides

    return flag_overrides(args)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "totalz=[1]"], r"conf\.yaml: unknown lm config keys \['totalz'\]"),
        (["--set", "totals=many"], r"conf\.yaml: lm config\.totals must be a list"),
        (["--set", "run.batch_siz=2"], r"unknown run keys \['batch_siz'\]"),
        (["--set", "run.batch_size=two"], r"run\.batch_size must be a number"),
        (["--methods", "cepe,fulll"], r"methods: unknown \['fulll'\]"),
    ],
)
def test_eval_config_errors_name_the_key(tmp_path, capsys, extra, message):
    """Checked before any model loads (``--model`` names nothing loadable here)."""
    import re

    conf = tmp_path / "conf.yaml"
    conf.write_text("totals: [160]\n")
    rc = main(["eval", "lm", "--model", str(tmp_path / "no-model"), "--config", str(conf), *extra])
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)


def test_prepare_data_config_is_the_function_signature():
    """The dataclass's fields are ``prepare_data``'s parameters, with the same defaults."""
    params = inspect.signature(prepare_data).parameters
    fields = {f.name: f for f in dataclasses.fields(PrepareDataConfig)}
    assert set(params) == set(fields)
    for name, p in params.items():
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if p.default is inspect.Parameter.empty:
            assert name in ("corpora", "out_dir")
        else:
            assert default == p.default, name


def test_prepare_data_flags_kept(tmp_path, capsys):
    args = _args(
        ["prepare-data", "a.txt", "b", "--corpora", "austen", "acl", "--out", "o", "--quiet", "--no-download"]
        + ["--max-docs", "3", "--seed", "1", "--test-fraction", "0.1", "--text-field", "body"]
    )
    cfg = config_from_cli(args)
    assert cfg == PrepareDataConfig(
        out_dir="o",
        corpora=["austen", "acl", "a.txt", "b"],
        progress=False,
        download=False,
        max_docs=3,
        seed=1,
        test_fraction=0.1,
        text_field="body",
    )
    conf = tmp_path / "data.yaml"
    conf.write_text("corpora: [austen]\nout_dir: x\nmax_docs: 5\n")
    cfg = config_from_cli(_args(["prepare-data", "--config", str(conf), "--max-docs", "6", "f.txt"]))
    assert (cfg.corpora, cfg.out_dir, cfg.max_docs, cfg.progress) == (["austen", "f.txt"], "x", 6, True)
    assert main(["prepare-data", "--out", str(tmp_path / "o"), "--set", "max_doc=3"]) == 2
    assert "unknown prepare-data config keys ['max_doc']" in capsys.readouterr().err
    assert main(["prepare-data", "--out", str(tmp_path / "o"), "--set", "max_docs=lots"]) == 2
    assert "prepare-data config.max_docs must be a number" in capsys.readouterr().err
    assert main(["prepare-data", "--corpora", "austen"]) == 2
    assert "missing required keys ['out_dir']" in capsys.readouterr().err


def test_main_generate_export_info_flags_kept():
    assert run_main.__defaults__ == tuple(f.default for f in dataclasses.fields(MainConfig))
    assert config_from_args(MainConfig, _args(["main", "--adapter", "d", "--quick"])) == MainConfig(
        "d", quick=True
    )
    args = _args(
        [
            "generate",
            "--prompt",
            "Why?",
            "--context",
            "c.txt",
            "--max-new-tokens",
            "6",
            "--decoder-tokens",
            "10",
        ]
        + ["--cache", "states"]
    )
    assert config_from_args(GenerateConfig, args) == GenerateConfig(
        "Why?", context="c.txt", max_new_tokens=6, decoder_tokens=10, cache="states"
    )
    assert GenerateConfig("x") == GenerateConfig("x", "default", None, 64, 0, None, True)  # the old defaults
    args = _args(["export", "--model", "a", "--out", "b", "--quantize", "int8", "--decoder-name", "default"])
    assert config_from_args(ExportConfig, args) == ExportConfig("a", "b", "int8", "default")
    args = _args(["export", "--model", "a", "--out", "b", "--quantize", "int8-g64"])
    assert config_from_args(ExportConfig, args) == ExportConfig("a", "b", "int8-g64")
    args = _args(["export", "--model", "a", "--out", "b", "--drop-mixture"])
    assert config_from_args(ExportConfig, args) == ExportConfig("a", "b", drop_mixture=True)
    assert config_from_args(InfoConfig, _args(["info"])) == InfoConfig("default")
    for argv in (
        ["generate"],
        ["export", "--model", "a"],
        ["generate", "--prompt", "p", "--cache", "kvv"],
        ["export", "--model", "a", "--out", "b", "--quantize", "int4"],
    ):
        with pytest.raises(SystemExit):  # required flags and choices are the parser's
            _args(argv)


def test_store_and_serve_flags_kept(tmp_path):
    args = _args(["context", "add", "f.txt", "--store", "s", "--model", "tiny", "--dtype", "fp32"])
    assert config_from_args(ContextAddConfig, args) == ContextAddConfig("s", "tiny", "fp32")
    assert args.paths == ["f.txt"]
    args = _args(
        [
            "ask",
            "Who?",
            "--store",
            "s",
            "--context",
            "a, b",
            "--budget",
            "10",
            "--retriever",
            "dense",
            "--json",
        ]
    )
    cfg = config_from_args(AskConfig, args)
    assert cfg == AskConfig("s", "a, b", budget=10, retriever="dense", json=True) and args.question == "Who?"
    assert cfg.context_ids() == ["a", "b"]
    args = _args(
        [
            "serve",
            "--store",
            "s",
            "--port",
            "9",
            "--max-queue",
            "2",
            "--timeout",
            "1.5",
            "--shutdown-grace",
            "60",
        ]
        + ["--no-auth", "--threads", "1", "--max-new-tokens", "256", "--host", "0.0.0.0"]
    )
    cfg = config_from_args(ServeConfig, args)
    limits = ServeLimits(max_queue=2, request_timeout_s=1.5, shutdown_grace_s=60.0, max_new_tokens=256)
    assert cfg == ServeConfig("s", port=9, allow_no_auth=True, threads=1, host="0.0.0.0", limits=limits)
    conf = tmp_path / "serve.yaml"
    conf.write_text("store: st\nlimits: {max_queue: 3, max_prompt_tokens: 100}\n")
    cfg = config_from_args(ServeConfig, _args(["serve", "--config", str(conf), "--limits.max-queue", "4"]))
    assert (cfg.store, cfg.limits.max_queue, cfg.limits.max_prompt_tokens) == ("st", 4, 100)
    conf.write_text("store: st\nlimits: {max_queu: 3}\n")
    with pytest.raises(ValueError, match=r"unknown serve config\.limits keys \['max_queu'\]"):
        config_from_args(ServeConfig, _args(["serve", "--config", str(conf)]), "serve config")


def test_serve_limits_that_serve_nothing_are_refused():
    """A limit with which no request could be served is refused naming its flag (before, --max-queue 0
    answered every request 429 and --timeout 0 every one 503)."""
    for flag, value, said in (
        ("--max-queue", "0", "--max-queue must be at least 1, got 0"),
        ("--max-new-tokens", "0", "--max-new-tokens must be at least 1"),
        ("--max-prompt-tokens", "-3", "--max-prompt-tokens must be at least 1"),
        ("--timeout", "0", "--timeout must be more than 0 seconds"),
        ("--shutdown-grace", "-1", "--shutdown-grace must be 0 seconds or more"),
        # infinite or NaN: was accepted, then OverflowError / ValueError in serve() after the model loaded
        (
            "--shutdown-grace",
            "inf",
            r"--shutdown-grace must be 0 seconds or more \(a finite number\), got inf",
        ),
        (
            "--shutdown-grace",
            "nan",
            r"--shutdown-grace must be 0 seconds or more \(a finite number\), got nan",
        ),
    ):
        with pytest.raises(ValueError, match=said):
            config_from_args(ServeConfig, _args(["serve", "--store", "s", flag, value]))
    assert ServeLimits(shutdown_grace_s=0.0).shutdown_grace_s == 0.0


def test_eval_autocast_auto_follows_the_machine(monkeypatch):
    """--autocast auto: bf16 where it is the fast path (CEPE_BF16 decides here), none where it is emulated;
    named dtypes pass through and unknown ones are refused with the choices."""
    import torch

    from cepe.eval.api import resolve_autocast

    assert EvalRunConfig(autocast="auto").autocast == "auto"
    monkeypatch.setenv("CEPE_BF16", "0")
    assert resolve_autocast("auto", "cpu") is None
    monkeypatch.setenv("CEPE_BF16", "1")
    assert resolve_autocast("auto", "cpu") is torch.bfloat16
    assert resolve_autocast("bf16", "cpu") is torch.bfloat16
    assert resolve_autocast(None, "cpu") is None
    with pytest.raises(ValueError, match="autocast must be auto, bf16 or fp16"):
        EvalRunConfig(autocast="bf15")


def test_eval_configs_score_only_documents_never_trained_on():
    """Every bundled eval config that reads a training corpus (austen, acl, stdlib) reads its test,
    retrieval or validation documents of the training data's split (seed 1, 10 % test / 5 % retrieval),
    except the configs made to score training text (``*_train.yaml``); ralm splits by its own fields."""
    import glob

    import yaml

    trained = {"austen", "acl", "stdlib"}
    split = {"split_seed": 1, "test_fraction": 0.1, "retrieval_fraction": 0.05}
    bad = []
    for path in sorted(glob.glob("configs/eval/*.yaml")):
        if path.endswith("_train.yaml"):
            continue
        cfg = yaml.safe_load(open(path)) or {}
        for key in ("sources", "haystack", "source", "essays"):
            srcs = cfg.get(key) or []
            for src in srcs if isinstance(srcs, list) else [srcs]:
                if not isinstance(src, dict) or src.get("corpus") not in trained:
                    continue
                if "ralm" in path:  # its own split of these sources
                    if any(cfg.get(k) != v for k, v in split.items()):
                        bad.append((path, "ralm split"))
                elif src.get("split") not in ("test", "retrieval", "val") or any(
                    src.get(k) != v for k, v in split.items()
                ):
                    bad.append((path, src))
    assert not bad


def test_eval_config_mistakes_are_refused_before_any_model_loads(tmp_path, capsys):
    """A misspelt or ill-typed method option, a --set value or a config file that is not YAML: each a clear
    error naming it (before: ignored, a failure after the model loaded, or a traceback); null for a field
    that needs a value is its default (before: None, which failed after the evaluation ran)."""
    for sets, said in (
        (["methods.streamingllm.recent_token=508"], "methods.streamingllm.recent_token: not an option"),
        (["methods.streaming.stride=4"], "methods.streaming: unknown method"),
        (["methods.streamingllm.stride=abc"], r"methods.streamingllm.stride must be a number \(int\)"),
        (["methods.streamingllm.stride=2.5"], r"methods.streamingllm.stride must be a number \(int\)"),
        (["methods.streamingllm.sink_tokens=true"], r"methods.streamingllm.sink_tokens must be a number"),
        (["methods.replug.temperature=true"], r"methods.replug.temperature must be a number \(float\)"),
    ):
        with pytest.raises(ValueError, match=said):
            load_eval_config("lm", "configs/eval/lm.yaml", sets, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("totals: [1,\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_eval_config("lm", str(bad), [], [])
    run, _, _ = load_eval_config("lm", "configs/eval/lm.yaml", ["run.out=", "run.seed="], [])
    assert run.out is not None and run.seed is not None
    assert main(["eval", "lm", "--model", "tiny", "--set", "totals=[1,"]) == 2
    assert "cannot read '[1,' as a value" in capsys.readouterr().err
    # an overflowing number and a zero divisor are errors with the reason, not tracebacks
    assert main(["bench", "--set", "repeats=.inf"]) == 2
    assert "repeats must be a number (int)" in capsys.readouterr().err
    assert main(["bench", "--encoder-heads", "0"]) == 2
    assert "encoder_heads must be positive" in capsys.readouterr().err
