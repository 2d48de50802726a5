"""The recipe route on one accelerator, under a deadline.

Runs route stages with their configs unchanged (by default fast_warmup → fast_direct_copy →
fast_direct_recall2 → fast_direct_8kd → fast_fold; ``--stages`` names others, in training order; each
resumed if it has checkpoints, skipped if done; a stage starts from the adapter its config's
``init_adapter`` names), probes the last stage's end with scripts/probe_stage.sh, then continues with
fast_fold_long (when the last stage is fast_fold) for as many steps as the time left allows (from the last
stage's measured seconds a step), probes that end too, and writes into OUT:

- ``gpu_route.json``: the device, each stage's wall time, steps and last logged loss, the probes' seconds;
- ``results.tar.gz``: the probes (results/recipe/NAME/stepNNN/), the stages' logs and status files;
- ``NAME.int8.safetensors.partNN`` + ``NAME.cepe_config.json``: the last adapter in int8 storage (``cepe
  export --quantize int8``), cut into pieces of at most 15 MiB (``--given NAME=DIR/NAME`` joins them back
  into an adapter directory, or ``cat`` them in order); the other adapter's pieces go to ``--keep`` when
  given.

``--given NAME=PATH`` stands a stage's end adapter in for training it (an adapter directory, or the
prefix DIR/NAME of its export pieces or of its exact pieces from ``device_kit.py cut``, carried by earlier
calls): the stage counts as done and the stages that start from it start from PATH. ``--return-fp32 DIR``
brings back the last finished stage's end exactly instead of the int8 export (a training checkpoint's
adapter, about 142 MB, in three pieces: the first in OUT, each other for one more call, ``cp
DIR/NAME.fp32.safetensors.partNN $OUT/``; ``device_kit.py join`` checks and joins them here), so that a
CPU trains on from it. ``--average NAME STAGE STAGE ...`` writes the equal-weight
average of those stages' end adapters (``cepe.soup.average_adapters``) to runs/soup/NAME, probes it and
exports it as the last adapter. ``--parallel`` trains consecutive stages that start from
the same stage at the same time (an accelerator the route's small batches leave mostly idle; on a CPU they
would only share its cores). ``--no-probe`` leaves the probes to the CPU (they need the evaluation
corpora that ``bash scripts/setup.sh`` installs); ``--long none`` skips the continuation.

Usage: python scripts/gpu_route.py --minutes 9 --out DIR [--stages NAME ...] [--given NAME=PATH ...]
       [--average NAME STAGE STAGE ...] [--long NAME|none] [--parallel] [--no-probe] [--keep DIR] [--smoke]
       [--probe-all [--probe-suffix SUFFIX]] [--return-fp32 DIR]
       python scripts/gpu_route.py --minutes 2 --out DIR --export-rank N

``--probe-all`` probes every stage this run trained (its last checkpoint, also one a deadline stopped)
and every ``--given`` adapter at the same time, under ``NAME`` + ``--probe-suffix`` (the device's
results apart from this CPU's), ranks them by validation cells (the validation needles'
cells, then the lower ``lm_val`` mean: :func:`validation_score`) into ``gpu_route.json``, and exports the
best trained one. The probes need the corpora of ``device_kit.py pack-probes`` there. ``--export-rank N``
only exports the N-th trained adapter of an earlier ``--probe-all`` call's ranking on this machine.

``--smoke`` runs the same stages on a tiny random 30-layer decoder with the default vocabulary (3 steps a
stage, into runs/gpu_smoke/, no probes or export; an average is still written): a check that every stage
of the route runs on a device, in a minute or two. Where the first probe fails the others are skipped and
the route's adapters still come back. Time left is read before each step; a stage still running at the
deadline gets SIGTERM, which writes a checkpoint (``--resume`` continues it exactly).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
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
STAGES = ["fast_warmup", "fast_direct_copy", "fast_direct_recall2", "fast_direct_8kd", "fast_fold"]
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
FP32_PIECE = 48 * 2**20  # three pieces hold a 142 MB adapter; one fits a call with the tree
SMOKE_STEPS = 3
# a stage's init_adapter when it starts from another stage's checkpoint
_INIT = re.compile(r"^runs/recipe/([A-Za-z0-9_.-]+)/checkpoints/step_\d+/adapter/?$")


def _cepe() -> list[str]:
    found = shutil.which("cepe")
    return (
        [found]
        if found
        else [sys.executable, "-c", "import sys; from cepe.cli import main; sys.exit(main())"]
    )


def _config(name: str) -> dict:
    path = ROOT / f"configs/train/recipe/{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"error: no such stage: {path.relative_to(ROOT)}")
    return read_config_file(path)


def _steps(name: str) -> int:
    """The ``steps`` of a route stage's config."""
    return int(_config(name)["steps"])


def _kind(name: str) -> str:
    """The ``stage`` (warmup, cepe, ...) of a route stage's config."""
    return str(_config(name)["stage"])


def _parent(name: str) -> str | None:
    """The route stage whose checkpoint ``name`` starts from (its config's ``init_adapter``), if any."""
    m = _INIT.match(str(_config(name).get("init_adapter") or ""))
    return m.group(1) if m else None


def _done(out: Path) -> bool:
    return (read_status(out) or {}).get("state") == "done"


def _last_step(out: Path) -> int | None:
    found = checkpoint_dirs(out)
    return found[-1][0] if found else None


def _last_loss(out: Path) -> float | None:
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    return losses[-1] if losses else None


def end_adapter(runs: Path, name: str, steps: int, given: dict[str, Path]) -> Path:
    """Where stage ``name``'s end adapter is: the one given for it, else its checkpoint at ``steps``."""
    return given[name] if name in given else runs / name / f"checkpoints/step_{steps:06d}/adapter"


def check_starts(stages: list[str], given: dict[str, Path], end_of) -> None:
    """Fail before any training when a stage starts from an adapter that this run neither trains nor has."""
    trained: set[str] = set()
    for name in stages:
        parent = _parent(name)
        if parent and parent not in trained and parent not in given and not end_of(parent).is_dir():
            raise SystemExit(
                f"error: stage {name} starts from {parent}'s end adapter ({end_of(parent)}), which is not "
                f"there and which this run neither trains (--stages) nor is given (--given {parent}=PATH)"
            )
        trained.add(name)


def cut_fp32(adapter: Path, dest: Path, name: str, piece: int | None = None) -> list[str]:
    """An adapter directory as it is (its own dtype, fp32 for a training checkpoint's), cut into
    ``NAME.fp32.safetensors.partNN`` pieces of at most ``piece`` bytes in ``dest``, with
    ``NAME.cepe_config.json`` and ``NAME.sha256`` (the file's SHA-256, checked by :func:`join_pieces`): an
    exact copy that travels in calls of the device's size, to train on from where it stands. The pieces'
    names. ``piece``: default ``FP32_PIECE``."""
    piece = piece or FP32_PIECE
    data = (adapter / "adapter_model.safetensors").read_bytes()
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(adapter / "cepe_config.json", dest / f"{name}.cepe_config.json")
    (dest / f"{name}.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    names = []
    for i in range(math.ceil(len(data) / piece)):
        part = dest / f"{name}.fp32.safetensors.part{i:02d}"
        part.write_bytes(data[i * piece : (i + 1) * piece])
        names.append(part.name)
    return names


def return_fp32(stages: list[str], runs: Path, end_of, keep: Path, out: Path) -> dict | None:
    """Cut the end adapter of the last of ``stages`` that is done (``end_of(name)``) into exact pieces in
    ``keep`` (:func:`cut_fp32`) and copy the first, the config and the SHA-256 into ``out``; what was cut
    (None where no stage is done)."""
    finished = [n for n in stages if _done(runs / n)]
    if not finished:
        return None
    name = finished[-1]
    pieces = cut_fp32(end_of(name), keep, name)
    now = [pieces[0], f"{name}.cepe_config.json", f"{name}.sha256"]
    out.mkdir(parents=True, exist_ok=True)
    for f in now:
        shutil.copy(keep / f, out / f)
    later = " ".join(f"`cp {keep / p} $OUT/`" for p in pieces[1:])
    print(f"{name}'s end adapter: {pieces[0]} in {out}; the next calls: {later or 'none'}", flush=True)
    return {"stage": name, "pieces": pieces, "in_out": now, "dir": str(keep)}


def join_pieces(prefix: Path, dest: Path) -> Path:
    """The inverse of :func:`export_int8` and :func:`cut_fp32`: ``PREFIX.int8.safetensors.partNN`` (or
    ``.fp32.``) in order plus ``PREFIX.cepe_config.json`` make the adapter directory ``dest`` (returned);
    ``PREFIX.sha256``, where present, must match the joined file."""
    kinds = {
        k: sorted(prefix.parent.glob(f"{prefix.name}.{k}.safetensors.part[0-9][0-9]"))
        for k in ("int8", "fp32")
    }
    found = [k for k, v in kinds.items() if v]
    config = prefix.parent / f"{prefix.name}.cepe_config.json"
    if len(found) != 1 or not config.is_file():
        raise SystemExit(
            f"error: {prefix} is neither an adapter directory nor the prefix of one set of pieces "
            f"({prefix.name}.int8.safetensors.part00 ... or {prefix.name}.fp32.safetensors.part00 ..., and "
            f"{prefix.name}.cepe_config.json; found pieces: {found or 'none'})"
        )
    pieces = kinds[found[0]]
    numbers = [int(p.name[-2:]) for p in pieces]
    if numbers != list(range(len(pieces))):
        raise SystemExit(f"error: pieces of {prefix} are missing: found parts {numbers}")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / "adapter_model.safetensors.tmp"
    h = hashlib.sha256()
    with open(tmp, "wb") as fh:
        for piece in pieces:
            data = piece.read_bytes()
            h.update(data)
            fh.write(data)
    want = prefix.parent / f"{prefix.name}.sha256"
    if want.is_file() and want.read_text().split()[0] != h.hexdigest():
        tmp.unlink()
        raise SystemExit(
            f"error: the pieces of {prefix} join into a file whose SHA-256 is not {want.name}'s: a piece is "
            "damaged or from another adapter; bring them again"
        )
    os.replace(tmp, dest / "adapter_model.safetensors")
    shutil.copy(config, dest / "cepe_config.json")
    return dest


def parse_given(items: list[str], joined: Path) -> dict[str, Path]:
    """``NAME=PATH`` pairs: an adapter directory is used as it is, export pieces are joined first (into
    ``joined``/NAME)."""
    given: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --given takes NAME=PATH, got {item!r}")
        p = Path(path)
        given[name] = p if (p / "cepe_config.json").is_file() else join_pieces(p, joined / name)
    return given


def run_stage(name: str, stage: str, runs: Path, extra: list[str], deadline: float, timeline: dict) -> bool:
    """Train (or resume) one stage until it is done or the deadline passes; True when it is done."""
    return run_stages([(name, stage, extra)], runs, deadline, timeline)


def run_stages(jobs: list[tuple[str, str, list[str]]], runs: Path, deadline: float, timeline: dict) -> bool:
    """Train (or resume) ``(name, stage, extra args)`` stages at the same time, each until it is done or the
    deadline passes (then SIGTERM: it checkpoints and exits); True when every one is done."""
    running = []
    for name, stage, extra in jobs:
        out = runs / name
        if _done(out):
            timeline["stages"].append({"name": name, "skipped": "done already"})
            continue
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
        fh = open(log, "a")  # closed below, once the process has ended
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        running.append((name, out, log, fh, proc, t0))
    all_done = True
    for name, out, log, fh, proc, t0 in running:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait()
        fh.close()
        done = _done(out)
        all_done = all_done and done
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
    return all_done


def sibling_groups(stages: list[str], parallel: bool) -> list[list[str]]:
    """``stages`` in training order, cut into groups that may train at the same time: with ``parallel``,
    consecutive stages that start from the same stage (trained before them); else one stage a group."""
    groups: list[list[str]] = []
    for name in stages:
        parent = _parent(name)
        if parallel and groups and parent is not None and parent not in groups[-1]:
            if _parent(groups[-1][0]) == parent:
                groups[-1].append(name)
                continue
        groups.append([name])
    return groups


def probe(name: str, step: int, timeline: dict, adapter: Path | None = None) -> None:
    """``scripts/probe_stage.sh NAME STEP`` (ICL and QA: FULL=1 later, where time is cheaper); ``adapter``
    probes that directory under the name (an average). Its output is printed."""
    if any(p["rc"] for p in timeline["probes"]):  # the evaluation assets are missing: do not spend time again
        return
    probe_many([(name, step, adapter)], math.inf, timeline)
    print((ROOT / "runs" / f"probe_{name}.log").read_text(errors="replace")[-5000:], flush=True)


TOTALS = (2048, 4096, 8192)


def validation_score(result: Path) -> tuple[float, float | None]:
    """``(cells, lm_val)`` of a probe folder (results/recipe/NAME/stepNNN): the validation needles' cells
    answered (the first needle's share at each total from ``calibrate.json``, the others' from their
    ``needle.json``; five depths a total, half answers count half; 15 a needle) and the mean of
    ``lm_val`` at 1K and 2K (``None`` where not written)."""
    cells, lm = 0.0, None
    cal = result / "calibrate.json"
    if cal.is_file():
        row = json.loads(cal.read_text())["rows"][0]
        cells += sum(row.get(f"needle_{t}", 0.0) for t in TOTALS) / 100 * 5
        if "lm_val_1024" in row and "lm_val_2048" in row:
            lm = (row["lm_val_1024"] + row["lm_val_2048"]) / 2
    for name in ("needle_val2", "needle_val3", "needle_val4"):
        path = result / name / "needle.json"
        if path.is_file():
            cells += (
                sum(r["value"] for r in json.loads(path.read_text())["rows"] if r["method"] == "cepe") / 100
            )
    return cells, lm


def rank(scores: dict[str, tuple[float, float | None]]) -> list[str]:
    """Names by validation cells, most first; ties by the lower ``lm_val`` (a missing one last)."""
    return sorted(scores, key=lambda n: (-scores[n][0], math.inf if scores[n][1] is None else scores[n][1]))


def probe_many(items: list[tuple[str, int, Path | None]], deadline: float, timeline: dict) -> None:
    """``scripts/probe_stage.sh`` for ``(name, step, adapter)`` items at the same time (one device; the
    host's cores shared out; adapter None: the stage's own checkpoint), each stopped with its evaluations
    at the deadline; logs ``runs/probe_NAME.log``, rows into ``timeline['probes']``."""
    threads = str(max(1, (os.cpu_count() or 2) // max(1, len(items))))
    running = []
    for name, step, adapter in items:
        env = {**os.environ, "OMP_NUM_THREADS": threads, **({"ADAPTER": str(adapter)} if adapter else {})}
        (ROOT / "runs").mkdir(exist_ok=True)
        log = open(ROOT / "runs" / f"probe_{name}.log", "w")  # closed below, once the probe has ended
        proc = subprocess.Popen(
            ["bash", "scripts/probe_stage.sh", name, str(step)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: a stop at the deadline ends its evaluations too
        )
        running.append((name, step, proc, log, time.time()))
    for name, step, proc, log, t0 in running:
        try:
            rc = proc.wait(timeout=None if math.isinf(deadline) else max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        log.close()
        text = (ROOT / "runs" / f"probe_{name}.log").read_text(errors="replace")
        row = {"name": name, "step": step, "rc": rc, "seconds": round(time.time() - t0, 1)}
        row["summary"] = text.strip().splitlines()[-12:]
        timeline["probes"].append(row)
        print(
            f"[{time.time() - timeline['t0']:6.0f} s] probe {name}: rc {rc}, {row['seconds']} s", flush=True
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


def _end_step(runs: Path, name: str) -> tuple[int, Path]:
    """A stage's last checkpoint step and adapter (its end, or where a deadline stopped it)."""
    step = _last_step(runs / name)
    return step, runs / name / f"checkpoints/step_{step:06d}/adapter"


def export_ranked(n: int, out: Path) -> int:
    """Export the ``n``-th trained adapter (1 = best) of the ranking an earlier ``--probe-all`` call wrote
    on this machine (``runs/gpu_route_last.json``)."""
    saved = ROOT / "runs" / "gpu_route_last.json"
    if not saved.is_file():
        raise SystemExit("error: no ranking here: run gpu_route.py --probe-all on this machine first")
    trained = [r for r in json.loads(saved.read_text()).get("ranking", []) if r["trained"]]
    if not 1 <= n <= len(trained):
        raise SystemExit(f"error: --export-rank {n}: the ranking holds {len(trained)} trained adapters")
    row = trained[n - 1]
    out.mkdir(parents=True, exist_ok=True)
    names = export_int8(ROOT / row["adapter"], out, row["name"])
    print(json.dumps({"exported": names, **row}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--minutes", type=float, required=True, help="wall-clock budget, probes and export included"
    )
    ap.add_argument("--out", type=Path, required=True, help="where the timeline, results and int8 adapter go")
    ap.add_argument("--keep", type=Path, default=None, help="where the other adapter's int8 pieces go")
    ap.add_argument(
        "--stages", nargs="+", default=STAGES, metavar="NAME", help="route stages in training order"
    )
    ap.add_argument(
        "--given", nargs="+", default=[], metavar="NAME=PATH", help="a stage's end adapter, not trained here"
    )
    ap.add_argument(
        "--average", nargs="+", default=None, metavar="NAME", help="NAME STAGE STAGE ...: average their ends"
    )
    ap.add_argument(
        "--long", default=None, help=f"the continuation stage, or none (default {LONG} after fast_fold)"
    )
    ap.add_argument("--no-probe", action="store_true", help="no probes here (run them on the CPU)")
    ap.add_argument(
        "--parallel", action="store_true", help="train consecutive stages with one parent at the same time"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny random decoder, 3 steps a stage, no probes or export"
    )
    ap.add_argument(
        "--probe-all",
        action="store_true",
        help="probe every trained stage and given adapter; export the best",
    )
    ap.add_argument(
        "--return-fp32",
        type=Path,
        default=None,
        metavar="DIR",
        help="cut the last finished stage's end adapter, exact, into pieces in DIR (the first also into --out, "
        "the others for the next calls to bring back); no int8 export then",
    )
    ap.add_argument("--probe-suffix", default="", help="appended to each name the probes write under")
    ap.add_argument(
        "--export-rank", type=int, default=None, metavar="N", help="export the N-th of an earlier --probe-all"
    )
    args = ap.parse_args(argv)
    if args.export_rank is not None:
        return export_ranked(args.export_rank, args.out)
    if args.average is not None and len(args.average) < 3:
        raise SystemExit("error: --average takes a name and at least two stages")
    t0 = time.time()
    end = t0 + 60 * args.minutes
    args.out.mkdir(parents=True, exist_ok=True)
    runs = ROOT / ("runs/gpu_smoke" if args.smoke else "runs/recipe")
    base = ROOT / ("runs/gpu_smoke" if args.smoke else "runs")  # where averages and joined adapters go
    given = parse_given(args.given, base / "given")
    stages = [s for s in args.stages if s not in given]
    long = (
        args.long if args.long is not None else (LONG if stages and _parent(LONG) == stages[-1] else "none")
    )
    long = None if long == "none" or args.smoke else long

    def steps_of(name: str) -> int:
        return SMOKE_STEPS if args.smoke else _steps(name)

    def end_of(name: str) -> Path:
        return end_adapter(runs, name, steps_of(name), given)

    check_starts(stages + ([long] if long else []), given, end_of)
    for name in (args.average or [])[1:]:
        if name not in stages and name not in given and not end_of(name).is_dir():
            raise SystemExit(f"error: --average names {name}, which this run neither trains nor is given")
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
    probing = not (args.smoke or args.no_probe)
    # seconds kept for the probes and the export
    reserve = 0 if args.smoke else (240 if args.probe_all else 150 if probing else 60)
    ok = True
    done_last = None
    for group in sibling_groups(stages, args.parallel):
        jobs = []
        for name in group:
            extra: list[str] = []
            parent = _parent(name)
            if args.smoke:
                extra = [
                    "--steps",
                    str(SMOKE_STEPS),
                    "--save-every",
                    str(SMOKE_STEPS),
                    *[a for k, v in TINY.items() for a in ("--tiny-decoder", f"{k}={v}")],
                ]
                # the tiny decoder's byte tokenizer cannot spell the corpus' questions: no qa examples
                extra += ["--set", "tasks={lm: 0.4, copy: 0.2, recall: 0.4}"] if _kind(name) == "cepe" else []
            if parent and (args.smoke or parent in given):
                extra += ["--init-adapter", str(end_of(parent))]
            jobs.append((name, _kind(name), extra))
        if not run_stages(jobs, runs, end - reserve, timeline):
            ok = False
            break
        done_last = (group[-1], steps_of(group[-1]))
    last: tuple[str, int] | None = None
    adapter: Path | None = None  # the last adapter, where it is not its stage's own checkpoint
    if ok and stages:
        last = done_last
        if probing:
            probe(*last, timeline)
        fold_row = next((r for r in timeline["stages"] if r["name"] == last[0] and "seconds" in r), None)
        step_s = fold_row["seconds"] / last[1] if fold_row else None
        probe_s = timeline["probes"][-1]["seconds"] if timeline["probes"] else 0.0
        if long and step_s:
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
                run_stage(long, _kind(long), runs, long_extra, end - probe_s - 60, timeline)
                step = _last_step(runs / long)
                if step:
                    if args.keep:
                        timeline["kept"] = export_int8(end_of(last[0]), args.keep, last[0])
                    if probing:
                        probe(long, step, timeline)
                    last = (long, step)
    if ok and args.average:
        name, members = args.average[0], args.average[1:]
        from cepe.soup import average_adapters

        adapter = average_adapters([end_of(m) for m in members], base / "soup" / name)
        timeline["average"] = {"name": name, "of": members, "adapter": str(adapter.relative_to(ROOT))}
        last = (name, steps_of(members[-1]))
        if probing:
            probe(*last, timeline, adapter=adapter)
    if args.probe_all and not args.smoke:
        items = [(f"{n}{args.probe_suffix}", *_end_step(runs, n)) for n in stages if _last_step(runs / n)]
        items += [
            (
                f"{n}{args.probe_suffix}",
                _steps(n) if (ROOT / f"configs/train/recipe/{n}.yaml").is_file() else 0,
                p,
            )
            for n, p in given.items()
        ]
        probe_many(items, end - 45, timeline)
        scores = {
            name: validation_score(ROOT / "results/recipe" / name / f"step{step:03d}")
            for name, step, _ in items
        }
        order = rank(scores)
        trained = {f"{n}{args.probe_suffix}": n for n in stages}
        timeline["ranking"] = [
            {
                "name": n,
                "cells": round(scores[n][0], 1),
                "lm_val": scores[n][1],
                "trained": n in trained,
                "adapter": os.path.relpath(next(a for m, _, a in items if m == n), ROOT),
            }
            for n in order
        ]
        best = next((n for n in order if n in trained), None)
        if best:  # the best trained adapter is the one exported, also where a stage failed
            step = next(st for m, st, _ in items if m == best)
            last, adapter, done_last = (trained[best], step), None, None
    if not ok and done_last:  # a stage failed: probe and export the last one that ended
        if probing:
            probe(*done_last, timeline)
        last = done_last
    if args.return_fp32 is not None:
        returned = return_fp32(stages, runs, end_of, args.return_fp32, args.out)
        if returned:
            timeline["returned"] = returned
    elif last and not args.smoke:
        path = adapter or runs / last[0] / f"checkpoints/step_{last[1]:06d}/adapter"
        timeline["exported"] = export_int8(path, args.out, last[0])
    timeline["seconds"] = round(time.time() - t0, 1)
    (args.out / "gpu_route.json").write_text(json.dumps(timeline, indent=2))
    if not args.smoke:
        shutil.copy(args.out / "gpu_route.json", ROOT / "runs" / "gpu_route_last.json")
    names = stages + ([long] if long else []) + ([args.average[0]] if args.average else [])
    names += [p["name"] for p in timeline["probes"] if p["name"] not in names]
    with tarfile.open(args.out / "results.tar.gz", "w:gz") as tar:
        for name in names:
            for p in (
                ROOT / "results/recipe" / name,
                runs / f"{name}.log",
                ROOT / "runs" / f"probe_{name}.log",
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
