"""The folded recipe route on one accelerator, under a deadline.

Runs the route's stages with their configs unchanged (fast_warmup → fast_direct_copy → fast_direct_recall2
→ fast_direct_8kd → fast_fold; each resumed if it has checkpoints, skipped if done), probes fast_fold's
end with scripts/probe_stage.sh, then continues with fast_fold_long for as many steps as the time left
allows (from fast_fold's measured seconds a step), probes that end too, and writes into OUT:

- ``gpu_route.json``: the device, each stage's wall time, steps and last logged loss, the probes' seconds;
- ``results.tar.gz``: the probes (results/recipe/NAME/stepNNN/), the stages' logs and status files;
- ``NAME.int8.safetensors.partNN`` + ``NAME.cepe_config.json``: the last adapter in int8 storage (``cepe
  export --quantize int8``), cut into pieces of at most 15 MiB (``cat`` them back in order); the other
  adapter's pieces go to ``--keep`` when given.

Usage: python scripts/gpu_route.py --minutes 9 --out DIR [--keep DIR] [--smoke]

``--smoke`` runs the same stages on a tiny random 30-layer decoder with the default vocabulary (3 steps a
stage, into runs/gpu_smoke/, no probes or export): a check that every stage of the route runs on a device, in a
minute. The probes need the evaluation corpora that ``bash scripts/setup.sh`` installs (the needle's essays,
the classification articles); where the first probe fails the others are skipped and the route's
adapters still come back. Time left is read before each step; a stage still running at the deadline gets SIGTERM, which
writes a checkpoint (``--resume`` continues it exactly).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from cepe.configio import read_config_file
from cepe.training.checkpoint import checkpoint_dirs
from cepe.training.runctl import read_status
from cepe.training.trainer import read_log

ROOT = Path(__file__).resolve().parent.parent
ROUTE = [
    ("fast_warmup", "warmup"),
    ("fast_direct_copy", "cepe"),
    ("fast_direct_recall2", "cepe"),
    ("fast_direct_8kd", "cepe"),
    ("fast_fold", "cepe"),
]
LONG = "fast_fold_long"
TINY = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 30,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": "true",
    "initializer_range": 0.02,
    "seed": 0,
}
PIECE = 15 * 2**20


def _cepe() -> list[str]:
    found = shutil.which("cepe")
    return (
        [found]
        if found
        else [sys.executable, "-c", "import sys; from cepe.cli import main; sys.exit(main())"]
    )


def _steps(name: str) -> int:
    """The ``steps`` of a route stage's config."""
    return int(read_config_file(ROOT / f"configs/train/recipe/{name}.yaml")["steps"])


def _done(out: Path) -> bool:
    return (read_status(out) or {}).get("state") == "done"


def _last_step(out: Path) -> int | None:
    found = checkpoint_dirs(out)
    return found[-1][0] if found else None


def _last_loss(out: Path) -> float | None:
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    return losses[-1] if losses else None


def run_stage(name: str, stage: str, runs: Path, extra: list[str], deadline: float, timeline: dict) -> bool:
    """Train (or resume) one stage until it is done or the deadline passes; True when it is done."""
    out = runs / name
    if _done(out):
        timeline["stages"].append({"name": name, "skipped": "done already"})
        return True
    cmd = [
        *_cepe(),
        "train",
        "--stage",
        stage,
        "--config",
        f"configs/train/recipe/{name}.yaml",
        "--output-dir",
        str(out),
        "--no-progress",
        *extra,
    ]
    if (out / "checkpoints").is_dir():
        cmd.append("--resume")
    log = runs / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"[{t0 - timeline['t0']:6.0f} s] {name}: {' '.join(cmd[-6:])}", flush=True)
    with open(log, "a") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait()
    done = _done(out)
    row = {
        "name": name,
        "seconds": round(time.time() - t0, 1),
        "rc": rc,
        "done": done,
        "last_checkpoint": _last_step(out),
        "last_loss": _last_loss(out),
    }
    timeline["stages"].append(row)
    print(f"[{time.time() - timeline['t0']:6.0f} s] {name}: {row}", flush=True)
    if rc != 0:
        print(log.read_text(errors="replace")[-3000:], flush=True)
    return done


def probe(name: str, step: int, timeline: dict) -> None:
    """``scripts/probe_stage.sh NAME STEP`` (ICL and QA: FULL=1 later, where time is cheaper)."""
    if any(p["rc"] for p in timeline["probes"]):  # the evaluation assets are missing: do not spend time again
        return
    t0 = time.time()
    proc = subprocess.run(
        ["bash", "scripts/probe_stage.sh", name, str(step)], cwd=ROOT, capture_output=True, text=True
    )
    print(proc.stdout[-3000:] + proc.stderr[-2000:], flush=True)
    timeline["probes"].append(
        {
            "name": name,
            "step": step,
            "rc": proc.returncode,
            "seconds": round(time.time() - t0, 1),
            "summary": proc.stdout.strip().splitlines()[-12:],
        }
    )


def export_int8(adapter: Path, dest: Path, name: str) -> list[str]:
    """``cepe export --quantize int8`` of ``adapter``, cut into pieces in ``dest``; the pieces' names."""
    tmp = dest / f".{name}.export"
    subprocess.run(
        [*_cepe(), "export", "--model", str(adapter), "--out", str(tmp), "--quantize", "int8"],
        cwd=ROOT,
        check=True,
    )
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp / "cepe_config.json", dest / f"{name}.cepe_config.json")
    data = (tmp / "adapter_model.safetensors").read_bytes()
    names = []
    for i in range(math.ceil(len(data) / PIECE)):
        piece = dest / f"{name}.int8.safetensors.part{i:02d}"
        piece.write_bytes(data[i * PIECE : (i + 1) * PIECE])
        names.append(piece.name)
    shutil.rmtree(tmp)
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--minutes", type=float, required=True, help="wall-clock budget, probes and export included"
    )
    ap.add_argument("--out", type=Path, required=True, help="where the timeline, results and int8 adapter go")
    ap.add_argument("--keep", type=Path, default=None, help="where the other adapter's int8 pieces go")
    ap.add_argument(
        "--only", nargs="*", default=None, help="run only these stages of the route (smoke checks)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny random decoder, 3 steps a stage, no probes or export"
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    end = t0 + 60 * args.minutes
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    timeline: dict = {
        "t0": t0,
        "device": dev,
        "minutes": args.minutes,
        "smoke": args.smoke,
        "stages": [],
        "probes": [],
    }
    runs = ROOT / ("runs/gpu_smoke" if args.smoke else "runs/recipe")
    prev = None
    reserve = 0 if args.smoke else 150  # seconds kept for the first probe and the export
    ok = True
    done_last = None
    for name, stage in [r for r in ROUTE if not args.only or r[0] in args.only]:
        extra: list[str] = []
        if args.smoke:
            extra = [
                "--steps",
                "3",
                "--save-every",
                "3",
                *[a for k, v in TINY.items() for a in ("--tiny-decoder", f"{k}={v}")],
            ]
            # the tiny decoder's byte tokenizer cannot spell the corpus' questions: no qa examples
            extra += ["--set", "tasks={lm: 0.4, copy: 0.2, recall: 0.4}"] if stage == "cepe" else []
            if prev:
                extra += ["--init-adapter", str(runs / prev / "checkpoints/step_000003/adapter")]
        if not run_stage(name, stage, runs, extra, end - reserve, timeline):
            ok = False
            break
        prev = name
        done_last = (name, _steps(name))
    fold_steps = _steps(ROUTE[-1][0])
    last = None
    if ok and not args.smoke:
        probe(ROUTE[-1][0], fold_steps, timeline)
        last = (ROUTE[-1][0], fold_steps)
        fold_row = next((r for r in timeline["stages"] if r["name"] == ROUTE[-1][0] and "seconds" in r), None)
        step_s = fold_row["seconds"] / fold_steps if fold_row else None
        probe_s = timeline["probes"][-1]["seconds"]
        if step_s:
            left = end - time.time() - probe_s - 90
            steps = min(1000, int(left / step_s) // 10 * 10)
            timeline["long_plan"] = {"step_s": round(step_s, 2), "steps": steps}
            if steps >= 20:
                long_extra = [
                    "--steps",
                    str(steps),
                    "--save-every",
                    str(max(10, steps // 4)),
                    "--keep-checkpoints",
                    "2",
                ]
                run_stage(LONG, "cepe", runs, long_extra, end - probe_s - 60, timeline)
                step = _last_step(runs / LONG)
                if step:
                    if args.keep:
                        timeline["kept"] = export_int8(
                            runs / ROUTE[-1][0] / f"checkpoints/step_{fold_steps:06d}/adapter",
                            args.keep,
                            ROUTE[-1][0],
                        )
                    probe(LONG, step, timeline)
                    last = (LONG, step)
    if not ok and not args.smoke and done_last:  # a stage failed: probe and export the last one that ended
        probe(*done_last, timeline)
        last = done_last
    if last:
        timeline["exported"] = export_int8(
            runs / last[0] / f"checkpoints/step_{last[1]:06d}/adapter", args.out, last[0]
        )
    timeline["seconds"] = round(time.time() - t0, 1)
    (args.out / "gpu_route.json").write_text(json.dumps(timeline, indent=2))
    with tarfile.open(args.out / "results.tar.gz", "w:gz") as tar:
        for name in [n for n, _ in ROUTE] + [LONG]:
            for p in (
                ROOT / "results/recipe" / name,
                runs / f"{name}.log",
                runs / name / "status.json",
                runs / name / "log.jsonl",
            ):
                if p.exists():
                    tar.add(p, arcname=str(p.relative_to(ROOT)))
        tar.add(args.out / "gpu_route.json", arcname="gpu_route.json")
    print(json.dumps({k: v for k, v in timeline.items() if k != "probes"}, indent=1), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
