"""The main job: CEPE on the default decoder, end to end, in minutes on a CPU.

Loads the trained adapter shipped in ``adapters/`` (or, if none is there, an untrained encoder, and says
so), then on held-out documents: a long-context perplexity table for CEPE against truncated, full
context, StreamingLLM and REPLUG; a needle-in-a-haystack grid; the copy probe (a passage in the
encoder, its first tokens in the decoder: perplexity of the rest); perplexity of fixed targets against
how much earlier text the model gets; and an answer generated from a long document that does not fit the
decoder window. Results land in ``--out`` as JSON, markdown and PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cepe.configio import add_config_flags, config_from_args
from cepe.fileio import write_text
from cepe.tables import pipe_table

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ADAPTER = REPO / "adapters" / "smollm2-135m-cepe"
METHODS = ["cepe", "truncated", "full", "streamingllm", "replug"]


@dataclass
class MainConfig:
    """The arguments of :func:`run_main`, which are the flags of ``cepe main``.

    Attributes:
        adapter: a CEPE adapter directory or a released checkpoint (default: the shipped
            adapters/smollm2-135m-cepe; when that is missing, an untrained encoder, announced as such; a
            given directory that holds neither is refused).
        out: output directory of ``main.json``, ``lm/`` and ``needle/``.
        quick: fewer lengths and sequences (a smoke run).
        config_dir: directory with ``lm.yaml`` and ``needle.yaml``, and optionally ``copy.yaml`` (the copy
            probe) and ``fixedppl.yaml`` (fixed-target perplexity against context length) (default: the
            repository's configs/main).
    """

    adapter: str | None = None
    out: str = "runs/main"
    quick: bool = False
    config_dir: str | None = None


def _load_config(path: Path, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The task config (validated by ``run_task``) and its method options."""
    from cepe.configio import read_config_file

    cfg = read_config_file(path, allow_empty=True)
    cfg.update(overrides)
    return cfg, cfg.pop("methods", {}) or {}


def run_main(
    adapter: str | Path | None = None,
    out: str | Path = "runs/main",
    quick: bool = False,
    config_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run the main job and write its reports under ``out`` (the arguments: :class:`MainConfig`).

    Returns:
        ``{"lm": result, "needle": result, "copy": result, "fixedppl": result, "generation": {...},
        "adapter": ..., "trained": bool}`` (``copy`` and ``fixedppl`` when their configs exist).
    """
    import torch

    from cepe.eval.api import is_cepe_dir, load_setup, run_task
    from cepe.eval.report import write_report
    from cepe.generation import generate_from_context

    out = Path(out)
    config_dir = Path(config_dir) if config_dir else REPO / "configs" / "main"
    given = bool(adapter)
    adapter = Path(adapter) if adapter else DEFAULT_ADAPTER
    # results name the adapter relative to the repository (no machine paths); loading uses the real path
    shown = adapter.relative_to(REPO) if adapter.is_absolute() and adapter.is_relative_to(REPO) else adapter
    trained = adapter.is_dir() and is_cepe_dir(adapter)
    if given and not trained:  # a mistyped path would otherwise measure an untrained encoder
        raise ValueError(
            f"--adapter {adapter}: no cepe adapter (cepe_config.json + adapter_model.safetensors) and no released "
            "CEPE checkpoint (config.json with encoder_config) there; give such a directory, or leave --adapter "
            "out for the shipped adapter"
        )
    torch.manual_seed(0)
    from cepe.compute import autocast_dtype, describe

    fast = autocast_dtype("cpu")
    print(f"== compute: {describe('cpu')}")
    if trained:
        print(f"== CEPE adapter: {shown}")
        setup = load_setup(str(adapter), METHODS, autocast_dtype=fast, batch_size=1)
    else:
        print(
            f"== NOTE: no trained adapter at {adapter}: the CEPE encoder is freshly initialised (zero o_proj),\n"
            "   so 'cepe' below equals 'truncated' by construction. Train one with the commands in README."
        )
        setup = load_setup("default", METHODS, cepe_init=True, autocast_dtype=fast, batch_size=1)
    results: dict[str, Any] = {
        "adapter": str(shown),
        "trained": trained,
        "compute_dtype": "bf16" if fast is not None else "fp32",
    }

    # (task, methods, overrides under --quick, table); copy and fixedppl (does the model read its context?)
    # run when their configs exist, so that a config_dir may hold only lm.yaml and needle.yaml
    parts = [
        ("lm", METHODS, {"totals": [1024, 4096], "sequences_per_domain": 1}, lm_table),
        ("needle", ["cepe", "truncated", "full"], {"totals": [1024]}, needle_table),
        (
            "copy",
            ["cepe", "truncated", "full"],
            {"passages_per_domain": 2},
            lambda r: method_table(r, "order"),
        ),
        ("fixedppl", METHODS, {"contexts": [0, 1024], "sequences": 2}, method_table),
    ]
    for task, methods, quick_set, table in parts:
        path = config_dir / f"{task}.yaml"
        if task in ("copy", "fixedppl") and not path.exists():
            continue
        t0 = time.time()
        cfg, opts = _load_config(path, quick_set if quick else {})
        setup.methods = methods
        setup.method_options = opts
        setup.reset_methods()
        res = run_task(task, setup, cfg)
        res.update(model=str(shown), config=cfg, methods=methods)
        write_report(res, out / task, x_key=res.get("plot_x"))
        results[task] = res
        print(table(res))
        print(f"({task}: {time.time() - t0:.0f} s)")

    results["generation"] = _generation_demo(setup, generate_from_context, fast)
    write_text(out / "main.json", json.dumps(results, indent=1, default=str))  # atomically
    written = ", ".join(f"{task}/" for task, *_ in parts if task in results)
    print(f"== results in {out}/ (main.json, {written})")
    return results


def _generation_demo(setup, generate_from_context, fast: Any) -> dict[str, Any]:
    """Answer a question about a held-out paper whose text is longer than the decoder window."""
    from cepe.eval.common import iter_source

    src = {
        "corpus": "acl",
        "split": "test",
        "split_seed": 1,
        "test_fraction": 0.1,
        "retrieval_fraction": 0.05,
    }
    doc = max(
        (d for d in iter_source(src) if 3000 < len(setup.encode(d["text"])) < 6000),
        key=lambda d: d["id"],
        default=None,
    )
    if doc is None:
        return {}
    model = setup.cepe_model
    prompt = "Summarize the main contribution of the paper above in one sentence."
    n_tokens = len(setup.encode(doc["text"]))
    answers = {}
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast is not None):
        answers["cepe"] = generate_from_context(
            model, setup.tokenizer, doc["text"], prompt, max_new_tokens=48, decoder_tokens=256
        )
        tail = setup.decode(setup.encode(doc["text"])[-256:])
        answers["truncated"] = generate_from_context(
            model, setup.tokenizer, tail, prompt, 48, decoder_tokens=256
        )
    print(
        f"\n== generation from a held-out paper ({doc['id']}, {n_tokens} tokens; decoder keeps the last 256)"
    )
    for k, v in answers.items():
        print(f"[{k}] {v.strip()}")
    return {"doc": doc["id"], "doc_tokens": n_tokens, "prompt": prompt, "answers": answers}


def lm_table(result: dict[str, Any]) -> str:
    """Perplexity table: one row per (domain, total), one column per method."""
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for r in result["rows"]:
        s = r["setting"]
        cells.setdefault((s["domain"], s["total"]), {})[r["method"]] = r["value"]
    methods = [m for m in METHODS if any(m in v for v in cells.values())]
    order = sorted(cells.items(), key=lambda kv: (kv[0][0] == "avg", kv[0]))
    rows = (
        [domain, total, *(f"{v.get(m, float('nan')):.2f}" for m in methods)] for (domain, total), v in order
    )
    return "\n".join(pipe_table(["domain", "total", *methods], rows))


def method_table(result: dict[str, Any], second: str | None = None) -> str:
    """One row per setting (its first key, then ``second``), one column per method: perplexity."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in result["rows"]:
        s = r["setting"]
        key = (next(iter(s.values())),) + ((s[second],) if second else ())
        cells.setdefault(key, {})[r["method"]] = r["value"]
    first = next(iter(result["rows"][0]["setting"])) if result["rows"] else "setting"
    methods = [m for m in METHODS if any(m in v for v in cells.values())]
    rows = ([*k, *(f"{v.get(m, float('nan')):.2f}" for m in methods)] for k, v in cells.items())
    return "\n".join(pipe_table([first, *([second] if second else []), *methods], rows))


def needle_table(result: dict[str, Any]) -> str:
    """Needle accuracy (%) per method and total, averaged over depths."""
    acc: dict[tuple[str, int], list[float]] = {}
    for r in result["rows"]:
        acc.setdefault((r["method"], r["setting"]["total"]), []).append(r["value"])
    rows = ([m, t, f"{sum(v) / len(v):.0f}"] for (m, t), v in sorted(acc.items()))
    return "\n".join(pipe_table(["method", "total", "accuracy % (mean over depths)"], rows))


def _cmd_main(args: argparse.Namespace) -> int:
    run_main(**asdict(config_from_args(MainConfig, args, "main config")))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``cepe main`` to the ``cepe`` command."""
    p = sub.add_parser(
        "main",
        help="the main job: trained CEPE vs baselines on held-out documents",
        description="The main job (run_main); every MainConfig field is a flag.",
    )
    add_config_flags(p, MainConfig)
    p.set_defaults(func=_cmd_main)


if __name__ == "__main__":
    from cepe.cliutil import run

    parser = argparse.ArgumentParser(prog="python -m cepe.main_job")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    sys.exit(run(parser, ["main", *sys.argv[1:]]))
