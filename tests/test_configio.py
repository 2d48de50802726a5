"""Flags generated from config dataclasses (:func:`cepe.configio.add_config_flags`): the same dataclass
(and training fingerprint) from a flag, a ``--set`` override or a config file; old flag spellings kept."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cepe.configio import add_config_flags, add_const_flag, config_from_args, field_docs, flag_overrides

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Inner:
    """Attributes:
    rate: a rate. seed: a seed.
    """

    rate: float = 0.5
    seed: int = 0


@dataclass
class Demo:
    """A demo.

    Attributes:
        name: the name, which goes on
            over two lines (30 %).
        a / b: two at once.
        flag: on or off.
        sizes: some sizes.
        mode: one of three.
        limits: per key.
    """

    name: str = "x"
    a: int = 1
    b: float | None = None
    flag: bool = False
    sizes: list[int] = field(default_factory=lambda: [1, 2])
    mode: str = field(default="p", metadata={"choices": ("p", "q", "r")})
    limits: dict[str, int] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    extra: bool | str = "auto"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_config_flags(p, Demo, config_file="a file")
    return p


def test_field_docs_reads_the_attributes_section():
    docs = field_docs(Demo)
    assert docs["name"] == "the name, which goes on over two lines (30 %)."
    assert docs["a"] == docs["b"] == "two at once."
    assert field_docs(Inner) == {"rate": "a rate.", "seed": "a seed."}


def test_generated_flags_types_defaults_and_precedence(tmp_path):
    p = _parser()
    assert config_from_args(Demo, p.parse_args([])) == Demo()
    args = p.parse_args(
        ["--name", "n", "--b", "2", "--flag", "--sizes", "3", "4", "--mode", "q", "--limits", "u=5"]
        + ["--inner.rate", "0.25", "--extra", "true"]
    )
    cfg = config_from_args(Demo, args)
    assert cfg == Demo(
        name="n", b=2.0, flag=True, sizes=[3, 4], mode="q", limits={"u": 5}, inner=Inner(0.25), extra=True
    )
    assert ("inner.rate", 0.25) in flag_overrides(args)
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "z"])
    with pytest.raises(SystemExit):
        p.parse_args(["--limits", "nokey"])
    # file < --set < flags; unknown keys in the file name it
    conf = tmp_path / "c.yaml"
    conf.write_text("name: file\na: 7\nlimits: {v: 1}\n")
    args = p.parse_args(
        ["--config", str(conf), "--set", "name=set", "--set", "a=8", "--a", "9", "--limits", "u=2"]
    )
    cfg = config_from_args(Demo, args)
    assert (cfg.name, cfg.a, cfg.limits) == ("set", 9, {"v": 1, "u": 2})
    assert config_from_args(Demo, p.parse_args(["--config", str(conf), "--no-flag"])).flag is False
    conf.write_text("nam: 1\n")
    with pytest.raises(ValueError, match=r"c\.yaml: unknown config keys \['nam'\]"):
        config_from_args(Demo, p.parse_args(["--config", str(conf)]))


@dataclass
class Needs:
    """Attributes:
    path: where to write.
    size: how much (default: all of it).
    progress: show progress.
    """

    path: str
    size: int | None = None
    progress: bool = True


def test_required_fields_const_flags_and_default_notes():
    """A field with no default is a required flag unless a ``--config`` file may give it; a constant flag
    (``--quiet``) sets its key like a generated one; a default the docstring states is not repeated."""
    p = argparse.ArgumentParser()
    add_config_flags(p, Needs)
    add_const_flag(p, "--quiet", "progress", False)
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert config_from_args(Needs, p.parse_args(["--path", "x", "--quiet"])) == Needs("x", None, False)
    assert config_from_args(Needs, p.parse_args(["--path", "x"])) == Needs("x")
    text = " ".join(p.format_help().split())
    assert "how much (default: all of it)." in text and "(default: None)" not in text
    assert "show progress. (default: True)" in text
    p = argparse.ArgumentParser()
    add_config_flags(p, Needs, config_file="a file")
    with pytest.raises(ValueError, match=r"missing required keys \['path'\]"):
        config_from_args(Needs, p.parse_args([]))


def _train_parser() -> argparse.ArgumentParser:
    from cepe.training import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_train_flags_give_the_config_the_override_strings_gave(tmp_path):
    """``--steps / --output-dir / --no-progress / --profile`` and ``--set`` build the same TrainConfig (and
    fingerprint) as the override strings they used to be turned into."""
    from cepe.training import cli
    from cepe.training.config import load_config

    path = ROOT / "configs" / "train" / "mini" / "cepe.yaml"
    argv = ["train", "--stage", "cepe", "--config", str(path), "--set", "optim.lr=1e-4", "--steps", "5"]
    argv += ["--output-dir", str(tmp_path), "--no-progress", "--profile", "3"]
    args = _train_parser().parse_args(argv)
    new = cli._load(args, "cepe")
    old = load_config(
        path,
        ["optim.lr=1e-4", "steps=5", f"output_dir={tmp_path}", "progress=false", "profile_steps=3"],
        stage="cepe",
    )
    assert new == old and new.fingerprint() == old.fingerprint()
    assert json.dumps(new.to_dict(), sort_keys=True) == json.dumps(old.to_dict(), sort_keys=True)
    # every field is a flag; nested ones as --section.key; a run needs no file
    args = _train_parser().parse_args(
        ["train", "--stage", "warmup", "--output-dir", str(tmp_path), "--data.synthetic", "random"]
        + [
            "--optim.lr",
            "1e-3",
            "--tiny-decoder",
            "hidden_size=32",
            "--bf16",
            "false",
            "--data.ratio",
            "1",
            "1",
        ]
    )
    cfg = cli._load(args, "warmup")
    assert (cfg.data.synthetic, cfg.optim.lr, cfg.tiny_decoder, cfg.bf16) == (
        "random",
        1e-3,
        {"hidden_size": 32},
        False,
    )
    assert cfg.data.ratio == [1, 1]
    same = load_config(
        {"output_dir": str(tmp_path), "data": {"synthetic": "random", "ratio": [1, 1]}, "bf16": False},
        ["optim.lr=1e-3", "tiny_decoder.hidden_size=32"],
        stage="warmup",
    )
    assert cfg.fingerprint() == same.fingerprint()


def test_one_dtype_map_takes_every_spelling():
    import torch

    from cepe.dtypes import torch_dtype

    for names, dt in ((("fp32", "float32"), torch.float32), (("bf16", "bfloat16"), torch.bfloat16)):
        assert all(torch_dtype(n) is dt for n in names)
    assert torch_dtype("fp16") is torch_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        torch_dtype("int8")


def test_extends_merges_sections_and_resolves_relative_paths(tmp_path):
    from cepe.configio import merge_configs, read_config_file
    from cepe.training.config import load_config

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "stage.yaml").write_text(
        "stage: cepe\noutput_dir: runs/x\ndata: {synthetic: random}\nsteps: 40\ntasks: {lm: 0.5, recall: 0.5}\noptim: {lr: 5.0e-5, warmup_ratio: 0.05}\n"
        "chunk_lengths: [64, 128]\n"
    )
    (tmp_path / "child.yaml").write_text(
        "extends: base/stage.yaml\nsteps: 10\noptim: {lr: 1.0e-4}\nchunk_lengths: [256]\n"
    )
    (tmp_path / "grandchild.yaml").write_text("extends: [child.yaml]\ntasks: {recall: 0.8}\n")
    data = read_config_file(tmp_path / "grandchild.yaml")
    assert data == {
        "stage": "cepe",
        "output_dir": "runs/x",
        "data": {"synthetic": "random"},
        "steps": 10,
        "tasks": {"lm": 0.5, "recall": 0.8},
        "optim": {"lr": 1.0e-4, "warmup_ratio": 0.05},
        "chunk_lengths": [256],
    }
    cfg = load_config(tmp_path / "grandchild.yaml")
    assert cfg.steps == 10 and cfg.optim.lr == 1e-4 and cfg.optim.warmup_ratio == 0.05
    # the same config written out whole gives the same training config (and so the same fingerprint)
    (tmp_path / "whole.json").write_text(json.dumps(data))
    assert load_config(tmp_path / "whole.json") == cfg
    base = {"a": {"b": 1}}
    assert merge_configs(base, {"a": {"c": 2}, "d": None}) == {"a": {"b": 1, "c": 2}, "d": None}
    assert base == {"a": {"b": 1}}


def test_extends_errors_name_the_file(tmp_path):
    from cepe.configio import read_config_file

    (tmp_path / "a.yaml").write_text("extends: b.yaml\nsteps: 1\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ValueError, match="comes back to a file already in the chain"):
        read_config_file(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml not found \(extended by"):
        read_config_file(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("extends: {x: 1}\n")
    with pytest.raises(ValueError, match="extends must be a config file path"):
        read_config_file(tmp_path / "d.yaml")
    (tmp_path / "e.yaml").write_text("extends: []\n")
    with pytest.raises(ValueError, match="extends must be a config file path"):
        read_config_file(tmp_path / "e.yaml")


def test_sections_choices_and_list_items_are_checked_by_the_loader(tmp_path):
    """Before, a section given a scalar passed through (a traceback where it was used), ``choices`` held only
    for the flag (a file or ``--set`` could give anything), and list items were never checked (``["4096"]``
    and ``[4096.5]`` reached the code as they were). Now the loader refuses or converts them like scalars."""
    from cepe.bench.config import BenchConfig, StoreBenchConfig
    from cepe.configio import build, load_config
    from cepe.serve_config import ServeConfig

    with pytest.raises(
        ValueError, match=r"serve\.limits is a section: give it a mapping .*--set limits\.KEY=VALUE\), got 5"
    ):
        build(ServeConfig, {"store": "s", "limits": 5}, "serve")
    assert build(ServeConfig, {"store": "s", "limits": None}, "serve").limits.max_queue > 0  # null: defaults
    with pytest.raises(
        ValueError, match=r"serve\.dtype must be one of \['bf16', 'fp32', 'fp16'\], got 'fp64'"
    ):
        build(ServeConfig, {"store": "s", "dtype": "fp64"}, "serve")
    with pytest.raises(ValueError, match=r"c\.cache must be one of .*got 'foo'"):
        build(StoreBenchConfig, {"cache": "foo"}, "c")
    with pytest.raises(ValueError, match=r"c\.store_dtype must be one of .*got 'int8'"):
        build(StoreBenchConfig, {"store_dtype": "int8"}, "c")
    with pytest.raises(ValueError, match=r"c\.methods: unknown methods \['nope'\]; choose from \['cepe'"):
        build(BenchConfig, {"methods": ["cepe", "nope"]}, "c")
    with pytest.raises(ValueError, match=r"c\.lengths\[0\] must be an integer, got 4096\.5"):
        build(BenchConfig, {"lengths": [4096.5]}, "c")
    with pytest.raises(ValueError, match=r"c\.lengths\[1\] must be a number \(int\), got 'lots'"):
        build(StoreBenchConfig, {"lengths": [1, "lots"]}, "c")
    assert build(StoreBenchConfig, {"lengths": ["4096", 8192.0]}, "c").lengths == [4096, 8192]  # as scalars
    with pytest.raises(ValueError, match=r"lengths\[0\] must be a number \(int\), got '1\.5e4'"):
        load_config(BenchConfig, overrides=["lengths=[1.5e4, 2048]"])  # as for an int: YAML's text, refused
    with pytest.raises(ValueError, match=r"d\.name must be a string"):  # scalar rules unchanged
        build(Demo, {"name": 3}, "d")
    with pytest.raises(ValueError, match=r"d\.sizes\[0\] must be a number \(int\), got \[1\]"):
        build(Demo, {"sizes": [[1]]}, "d")
    with pytest.raises(ValueError, match=r"d\.mode must be one of \['p', 'q', 'r'\], got 's'"):
        build(Demo, {"mode": "s"}, "d")
    # items already of their type are kept as they are (an int in a list[float] stays an int)
    from cepe.training.config import OptimConfig

    assert build(OptimConfig, {"betas": [1, 0.99]}, "o").betas == [1, 0.99]
    assert type(build(OptimConfig, {"betas": [1, 0.99]}, "o").betas[0]) is int
    assert build(OptimConfig, {"betas": ["0.9", 0.99]}, "o").betas == [0.9, 0.99]
    conf = tmp_path / "bad.yaml"
    conf.write_text("store: s\nlimits: 5\n")
    from cepe.cli import main

    assert main(["serve", "--config", str(conf)]) == 2  # was an AttributeError traceback after loading


def test_dict_flag_keys_with_a_dot_stay_one_key(tmp_path):
    """A ``dict`` flag's KEY may hold a dot (``optim.lr_by_name`` names parameters, ``mix_head.bias``):
    before, ``--limits mix_head.bias=5`` nested it (``{"mix_head": {"bias": 5}}``) or, next to a
    ``mix_head`` key from the file, failed with "'mix_head' is not a section"."""
    p = _parser()
    conf = tmp_path / "c.yaml"
    conf.write_text("limits: {mix_head: 1, mix_head.bias: 2}\n")
    args = p.parse_args(["--config", str(conf), "--limits", "mix_head.bias=5", "--limits", "other=3"])
    assert config_from_args(Demo, args).limits == {"mix_head": 1, "mix_head.bias": 5, "other": 3}
    # the training command's own dict flag, on the keys the recipes use
    from cepe.cli import build_parser
    from cepe.training.config import load_config

    args = build_parser().parse_args(
        ["train", "--stage", "cepe", "--optim.lr-by-name", "mix_head.bias=0.1", "--optim.lr-by-name", "x=1"]
    )
    base = {"output_dir": str(tmp_path), "data": {"synthetic": "random"}}
    base["optim"] = {"lr_by_name": {"mix_head": 2e-3, "mix_head.bias": 0.05}}
    cfg = load_config(base, flag_overrides(args), stage="cepe")
    assert cfg.optim.lr_by_name == {"mix_head": 2e-3, "mix_head.bias": 0.1, "x": 1}
