"""Training speed before / after, measured as ratios in one process: for each stage, short runs of the
reference path (``reference_path: true``) and the fast path alternate (A B A B ...), each on the same
config and examples; the mean step time excludes each run's first step.

    PYTHONPATH=. python scripts/train_speed.py --stages warmup cepe --steps 3 --rounds 2 \
        --out results/train_speed

Writes ``OUT/train_speed.json``, ``OUT/train_speed.md`` and per-op profiles ``OUT/profile_{stage}_{path}.txt``
(``--profile N``). Default: the mini configs on the default decoder with synthetic windows (no data needed).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from cepe.fileio import write_text
from cepe.training.config import load_config
from cepe.training.trainer import read_log, train

MINI = Path(__file__).resolve().parents[1] / "configs" / "train" / "mini"
ENCODER = "{hidden_size: 256, num_hidden_layers: 4, num_attention_heads: 4, intermediate_size: 1024}"


def cpu_kind() -> str:
    """The CPU model and its bf16 matrix features, from lscpu."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in text.splitlines() if ln.startswith("Flags")), "")
    feats = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return f"{name} ({', '.join(feats)})"


def one_run(stage: str, out: Path, steps: int, reference: bool, profile: int, extra: list[str]) -> dict:
    over = [
        f"output_dir={out}",
        "init_encoder=null",
        "init_adapter=null",
        "data.corpus=null",
        "data.synthetic=random",
        f"encoder={ENCODER}",
        "bf16=true",
        f"steps={steps}",
        f"save_every={steps}",
        "progress=false",
        f"reference_path={'true' if reference else 'false'}",
        f"profile_steps={profile}",
        *extra,
    ]
    cfg = load_config(MINI / f"{stage}.yaml", over)
    train(cfg)
    log = read_log(out)[1:]  # the first step pays for warm-up
    step_s = sum(r["step_s"] for r in log) / len(log)
    return {
        "step_s": step_s,
        "decoder_tokens_per_s": sum(r["decoder_tokens_per_s"] for r in log) / len(log),
        "encoder_tokens_per_s": sum(r["encoder_tokens_per_s"] for r in log) / len(log),
        "peak_fraction": sum(r["peak_fraction"] for r in log) / len(log),
        "losses": [r["loss"] for r in read_log(out)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", nargs="+", default=["warmup", "cepe"])
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs per stage")
    ap.add_argument("--profile", type=int, default=0, help="profile N steps in the first run of each path")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also time the fast path with this override (e.g. micro_batch_size=8), in the same rounds",
    )
    ap.add_argument("--out", default="results/train_speed")
    args = ap.parse_args()
    if args.steps < 2 or args.rounds < 1:
        ap.error(
            f"--steps {args.steps} --rounds {args.rounds}: each run's first step is not timed, so a "
            "measurement needs at least 2 steps a run and 1 round"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu_kind(), "threads": torch.get_num_threads(), "torch": torch.__version__, "stages": {}}
    for stage in args.stages:
        paths = {"reference": [], "fast": [], **{f"fast, {v}": [v] for v in args.variant}}
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        for r in range(args.rounds):
            for name, extra in paths.items():
                with tempfile.TemporaryDirectory() as tmp:
                    prof = args.profile if r == 0 and name in ("reference", "fast") else 0
                    over = [*args.set, *extra]
                    res = one_run(stage, Path(tmp) / "run", args.steps, name == "reference", prof, over)
                    if prof:
                        text = (Path(tmp) / "run" / "profile.txt").read_text()
                        write_text(out / f"profile_{stage}_{name}.txt", text)
                runs[name].append(res)
                print(f"{stage} {name} round {r}: {res['step_s']:.2f} s/step", flush=True)
        summary = {}
        for name, rs in runs.items():
            summary[name] = {
                k: sum(x[k] for x in rs) / len(rs)
                for k in ("step_s", "decoder_tokens_per_s", "encoder_tokens_per_s", "peak_fraction")
            }
        ref_dec = summary["reference"]["decoder_tokens_per_s"]
        for name in runs:
            summary[name]["speedup"] = summary[name]["decoder_tokens_per_s"] / ref_dec
        summary["first_loss"] = {n: rs[0]["losses"][0] for n, rs in runs.items()}
        summary["runs"] = runs
        result["stages"][stage] = summary
    write_text(out / "train_speed.json", json.dumps(result, indent=2) + "\n")
    lines = [
        f"CPU: {result['cpu']}, {result['threads']} threads, torch {result['torch']}",
        "",
        "| stage | path | s/step | decoder tok/s | encoder tok/s | % of matmul peak | decoder tok/s ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage, s in result["stages"].items():
        for name in s["runs"]:
            x = s[name]
            lines.append(
                f"| {stage} | {name} | {x['step_s']:.2f} | {x['decoder_tokens_per_s']:.0f} | "
                f"{x['encoder_tokens_per_s']:.0f} | {100 * x['peak_fraction']:.1f} | {x['speedup']:.2f} |"
            )
    write_text(out / "train_speed.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
