"""A candidate adapter's validation results against the shipped adapter's, cell by cell: the rule that
decides a replacement (the candidate must be better on every validation evaluation) as a command.

Both folders are what ``bash scripts/eval_val.sh ADAPTER OUT`` writes (``OUT/CONFIG/TASK.json`` per
validation config). Every validation config present in both is compared (``fixedppl_val``,
``fixedppl_val_short``, ``fixedppl_val_short_kernel``, ``lm_val``, ``copy_val``, ``needle_val*``, ``qa_val``;
not the reported test sets, nor the foreign-context control, whose lower perplexity is not better), on one
method's rows (``--method``, default ``cepe``), cell by cell:
- ``fixedppl_val*``: perplexity per context length (lower is better; the context-0 cell is the decoder
  alone, the same model under either adapter, and is left out);
- ``lm_val``: perplexity per total and domain, ``avg`` included (lower);
- ``copy_val``: the copy probe's perplexity per domain and order (lower);
- ``needle_val*``: accuracy per total, the mean over depths (higher); the gold answer's NLL (lower) as a
  second metric;
- ``qa_val``: exact match per k (higher); the gold answers' NLL per k (lower) as a second metric.
A cell is better or worse by any difference (``--tolerance``, a relative change, widens "same"; a change
from zero has no relative size and is left blank). A config's verdict comes from its first metric's
cells: "better" when none is worse and one is better, "worse" the other way round, "mixed" with both,
"same" with neither; the second metric's verdict is given beside it.
The last line applies the replacement rule: no config worse or mixed, and at least one better; a
validation config the base holds and the candidate lacks (an evaluation that failed or was not run), or
whose candidate result lacks some of the base's cells (a shorter run) or was computed in another dtype or
autocast than the base's (where both record it: an AVX2 machine's fp32 against an AMX machine's bf16), is
named there and rules the replacement out until it is run alike.
Where the fixed-target configs' context-0 cell (the decoder alone, left out of the comparison) differs
between the two runs, the report says so, with the CPUs the results record: the runs were computed on
machines that round bf16 differently (the same adapter's cells differed by up to 0.27 % between an AMX and
a Zen 4 CPU), so the candidate is better judged against the base run on its own kind; the rule still
counts every difference.
Without ``--base`` the base is chosen by the kind of CPU the candidate's results record (their bf16 units:
``amx_bf16``, ``avx512_bf16`` or ``avx2``): the shipped adapter's validation run on that kind (``BASES``),
else the default (the AMX run) with a line that says why and how to make a run on the candidate's kind.

Usage: python scripts/val_verdict.py CANDIDATE_DIR [--base results/recipe/mix_fit3/fit150_int8]
    [--method cepe] [--tolerance 0] [--out OUT]
(``--out OUT`` writes OUT.json and OUT.md; the markdown is printed either way.)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from cepe.fileio import write_json, write_text
from cepe.tables import pipe_table

BASE = "results/recipe/mix_fit3/fit150_int8"  # the shipped adapter's validation results
# The shipped adapter's validation runs by kind of CPU (bf16 units), each made with ONLY="<the default's
# validation configs>" bash scripts/eval_val.sh adapters/smollm2-135m-cepe OUT: the AMX run (an Intel
# Xeon; its results were written before they recorded their CPU) and a Zen 4 run (an AMD EPYC).
BASES = {"amx_bf16": BASE, "avx512_bf16": "results/recipe/mix_fit3/fit150_int8_zen4"}
TASKS = ("fixedppl", "lm", "copy", "needle", "qa")
VALIDATION = re.compile(r"^(fixedppl_val(_short(_kernel)?)?|lm_val|copy_val|needle_val\d*|qa_val)$")


def result(folder: Path) -> dict[str, Any]:
    """The one ``TASK.json`` a ``cepe eval`` wrote into ``folder``."""
    files = [p for p in folder.glob("*.json") if p.stem in TASKS]
    if len(files) != 1:
        raise SystemExit(f"{folder}: expected one cepe eval result (TASK.json), found {len(files)}")
    data = json.loads(files[0].read_text())
    if not isinstance(data, dict) or "rows" not in data or "task" not in data:
        raise SystemExit(f"{files[0]}: not a cepe eval result (no task / rows)")
    return data


def cpu_kind(note: str | None) -> str | None:
    """The kind of CPU a result's ``cpu`` record names: its first bf16 unit in parentheses (``"Intel(R)
    Xeon(R) (amx_bf16, avx512_bf16)"`` → ``amx_bf16``); None for no record or one without units."""
    m = re.search(r"\(([a-z0-9_]+)(?:, [a-z0-9_]+)*\)\s*$", note or "")
    return m.group(1) if m else None


def recorded_kinds(folder: Path) -> set[str | None]:
    """The kinds of CPU the validation results in ``folder`` record (None for a result without a record)."""
    kinds: set[str | None] = set()
    for p in sorted(folder.iterdir()):
        if p.is_dir() and VALIDATION.match(p.name) and any(p.glob("*.json")):
            kinds.add(cpu_kind(result(p).get("cpu")))
    return kinds


def choose_base(cand: Path, bases: dict[str, str] | None = None, default: str = BASE) -> tuple[str, str]:
    """The base for a candidate judged without ``--base``, and the line that says why: the base run on
    the kind of CPU every candidate result records, else ``default``."""
    bases = BASES if bases is None else bases
    kinds = recorded_kinds(cand)
    known = sorted(k for k in kinds if k)
    if len(known) > 1:
        why = f"its results were computed on several kinds of CPU ({', '.join(known)})"
    elif not known:
        why = "its results record no CPU"
    elif kinds != {known[0]}:
        why = f"some of its results record no CPU (the others {known[0]})"
    elif known[0] not in bases or not Path(bases[known[0]]).is_dir():
        configs = " ".join(sorted(p.name for p in Path(default).iterdir() if VALIDATION.match(p.name)))
        why = (
            f"the shipped adapter has no validation run on {known[0]}: make one with "
            f'ONLY="{configs}" bash scripts/eval_val.sh adapters/smollm2-135m-cepe OUT'
        )
    else:
        return bases[known[0]], f"base chosen by the candidate's CPU ({known[0]}): {bases[known[0]]}"
    return default, f"base: the default {default}, as {why}"


def cells(data: dict[str, Any], method: str) -> dict[str, tuple[float, bool, bool]]:
    """Cell name → (value, lower is better, first metric) of one result, for ``method``'s rows."""
    rows = [r for r in data["rows"] if r.get("method") == method]
    task = data["task"]
    out: dict[str, tuple[float, bool, bool]] = {}
    if task == "fixedppl":
        for r in rows:
            if r["setting"]["context"]:
                out[f"ppl, context {r['setting']['context']}"] = (float(r["value"]), True, True)
    elif task == "lm":
        for r in rows:
            out[f"ppl, {r['setting']['total']} {r['setting']['domain']}"] = (float(r["value"]), True, True)
    elif task == "copy":
        for r in rows:
            out[f"ppl, {r['setting']['domain']} {r['setting']['order']}"] = (float(r["value"]), True, True)
    elif task == "needle":
        for total in sorted({r["setting"]["total"] for r in rows}):
            at = [r for r in rows if r["setting"]["total"] == total]
            out[f"accuracy, {total}"] = (statistics.fmean(float(r["value"]) for r in at), False, True)
            nll = [float(r["answer_nll"]) for r in at if r.get("answer_nll") is not None]
            if len(nll) == len(at):
                out[f"answer NLL, {total}"] = (statistics.fmean(nll), True, False)
    elif task == "qa":
        for r in rows:
            out[f"exact match, k = {r['setting']['k']}"] = (float(r["value"]), False, True)
            if r.get("answer_nll") is not None:
                out[f"answer NLL, k = {r['setting']['k']}"] = (float(r["answer_nll"]), True, False)
    else:
        raise SystemExit(f"a {task!r} result: not one of the validation tasks ({', '.join(TASKS)})")
    if not out:
        raise SystemExit(f"no {method!r} rows in a {task} result (methods: {data.get('methods')})")
    return out


def compare(base: Path, cand: Path, method: str, tolerance: float) -> list[dict[str, Any]]:
    """One row per cell of every validation config both folders hold."""
    names = sorted(
        p.name
        for p in cand.iterdir()
        if VALIDATION.match(p.name) and any(p.glob("*.json")) and any((base / p.name).glob("*.json"))
    )
    if not names:
        raise SystemExit(f"{cand} and {base} hold no validation config in common (bash scripts/eval_val.sh)")
    rows = []
    for name in names:
        b, c = cells(result(base / name), method), cells(result(cand / name), method)
        for cell in [k for k in c if k in b]:
            (bv, lower, first), (cv, _, _) = b[cell], c[cell]
            change = (cv - bv) / abs(bv) if bv else None  # none relative to zero
            if cv == bv or (change is not None and abs(change) <= tolerance):
                verdict = "same"
            else:
                verdict = "better" if (cv < bv) == lower else "worse"
            rows.append(
                {
                    "config": name,
                    "cell": cell,
                    "first_metric": first,
                    "base": bv,
                    "candidate": cv,
                    "change": change,
                    "verdict": verdict,
                }
            )
    return rows


def missing(base: Path, cand: Path, method: str = "cepe") -> list[str]:
    """Validation configs with results in ``base`` and none in ``cand``, and those whose candidate result
    lacks some of the base's cells (a shorter run: named with the count), which are not compared whole."""
    out = []
    for p in sorted(base.iterdir()):
        if not (VALIDATION.match(p.name) and any(p.glob("*.json"))):
            continue
        if not any((cand / p.name).glob("*.json")):
            out.append(p.name)
            continue
        b, c = result(p), result(cand / p.name)
        lacks = set(cells(b, method)) - set(cells(c, method))
        if lacks:
            out.append(f"{p.name} (lacks {len(lacks)} of the base's cells, e.g. {sorted(lacks)[0]})")
            continue
        for key in ("dtype", "autocast"):  # recorded since these fields exist: compared where both say
            if key in b and key in c and b[key] != c[key]:
                out.append(f"{p.name} (computed with {key} {c[key]}, the base with {b[key]})")
                break
    return out


def decoder_alone(base: Path, cand: Path, method: str = "cepe") -> list[dict[str, Any]]:
    """Each fixed-target config's context-0 cell (the decoder alone: the same model under either adapter,
    left out of the comparison) in both runs, with the CPUs they record (``cpu``, absent in results
    written before it was recorded). Where the two values differ the runs were computed on machines that
    round differently."""
    out = []
    for p in sorted(cand.iterdir()):
        if not (p.name.startswith("fixedppl_val") and VALIDATION.match(p.name) and any(p.glob("*.json"))):
            continue
        if not any((base / p.name).glob("*.json")):
            continue
        b, c = result(base / p.name), result(p)
        if b["task"] != "fixedppl" or c["task"] != "fixedppl":
            continue
        zero = [
            next(
                (
                    float(r["value"])
                    for r in d["rows"]
                    if r.get("method") == method and not r["setting"]["context"]
                ),
                None,
            )
            for d in (b, c)
        ]
        if None in zero:
            continue
        out.append(
            {
                "config": p.name,
                "base": zero[0],
                "candidate": zero[1],
                "change": (zero[1] - zero[0]) / abs(zero[0]) if zero[0] else None,
                "base_cpu": b.get("cpu"),
                "candidate_cpu": c.get("cpu"),
            }
        )
    return out


def machine_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What the report says of the decoder-alone cells: nothing where they agree."""
    differ = [r for r in rows if r["base"] != r["candidate"]]
    if not differ:
        return []
    lines = []
    for r in differ:
        change = "" if r["change"] is None else f" ({100 * r['change']:+.2f} %)"
        cpus = f"CPU {r['base_cpu'] or 'not recorded'} and {r['candidate_cpu'] or 'not recorded'}"
        lines.append(
            f"The decoder alone (context 0, the same model under either adapter) scores {r['base']:.5g} in "
            f"the base's {r['config']} and {r['candidate']:.5g} in the candidate's{change}; {cpus}."
        )
    lines.append(
        "So the two were computed on machines that round differently; on such a pair the same adapter's "
        'cells differed by up to 0.27 % (docs/TRAINING.md, "A tenth new machine"): judge against the '
        "base run on the candidate's kind of CPU (--base). The rule below counts every difference."
    )
    return lines


def verdict_of(verdicts: set[str]) -> str:
    """better / worse / mixed / same from the cells' verdicts ("" without cells)."""
    if not verdicts:
        return ""
    if {"better", "worse"} <= verdicts:
        return "mixed"
    return "better" if "better" in verdicts else "worse" if "worse" in verdicts else "same"


def config_verdicts(rows: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Config → (its first metric's verdict, its second metric's)."""
    out = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        out[name] = (
            verdict_of({r["verdict"] for r in mine if r["first_metric"]}),
            verdict_of({r["verdict"] for r in mine if not r["first_metric"]}),
        )
    return out


def rule(verdicts: dict[str, tuple[str, str]], absent: list[str] | tuple[str, ...] = ()) -> tuple[bool, str]:
    """The replacement rule over the configs' first-metric verdicts, and the line that says it.

    ``absent``: validation configs the base holds and the candidate lacks; any rules a replacement out.
    """
    against = [f"{n}: {v[0]}" for n, v in verdicts.items() if v[0] in ("worse", "mixed")]
    better = [n for n, v in verdicts.items() if v[0] == "better"]
    ok = not against and bool(better) and not absent
    reasons = [f"worse or mixed on {', '.join(against)}"] if against else []
    if absent:
        reasons.append(f"not evaluated: {', '.join(absent)} (ONLY=CONFIG bash scripts/eval_val.sh)")
    if not better:
        reasons.append("better on none")
    why = "; ".join(reasons)
    line = "replaces the shipped adapter by the rule (no config worse or mixed, at least one better): " + (
        f"yes (better on {', '.join(better)})" if ok else f"no ({why})"
    )
    return ok, line


def report(
    rows: list[dict[str, Any]],
    base: str,
    cand: str,
    absent: list[str] | tuple[str, ...] = (),
    machines: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
    chosen: str = "",
) -> list[str]:
    verdicts = config_verdicts(rows)
    lines = [f"# validation: {cand} against {base}", "", *([chosen, ""] if chosen else [])]
    lines += pipe_table(
        ["config", "cell", "base", "candidate", "change", "verdict"],
        [
            [
                r["config"],
                r["cell"],
                f"{r['base']:.4g}",
                f"{r['candidate']:.4g}",
                "" if r["change"] is None else f"{100 * r['change']:+.2f} %",
                r["verdict"],
            ]
            for r in rows
        ],
    )
    lines += ["", *pipe_table(["config", "verdict", "answer NLL"], [[n, *v] for n, v in verdicts.items()])]
    if absent:
        lines += ["", f"not evaluated for the candidate: {', '.join(absent)}"]
    if note := machine_lines(list(machines)):
        lines += ["", *note]
    lines += ["", rule(verdicts, absent)[1]]  # the last line (heads_and_validate.sh prints it)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("candidate", help="the candidate's eval_val.sh output folder")
    ap.add_argument(
        "--base",
        help="the folder to beat (default: the shipped adapter's validation run on the kind of CPU the "
        f"candidate's results record, else {BASE})",
    )
    ap.add_argument("--method", default="cepe", help="the method whose rows are compared (default cepe)")
    ap.add_argument(
        "--tolerance", type=float, default=0.0, help="relative change counted as same (default 0)"
    )
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    cand = Path(args.candidate)
    if not cand.is_dir():
        raise SystemExit(f"{cand}: no such folder (the output folder of bash scripts/eval_val.sh)")
    chosen = ""
    if args.base is None:
        args.base, chosen = choose_base(cand)
    base = Path(args.base)
    if not base.is_dir():
        raise SystemExit(f"{base}: no such folder (the output folder of bash scripts/eval_val.sh)")
    if args.tolerance < 0:
        ap.error(f"--tolerance must be >= 0, got {args.tolerance}")
    rows = compare(base, cand, args.method, args.tolerance)
    absent = missing(base, cand, args.method)
    machines = decoder_alone(base, cand, args.method)
    lines = report(rows, args.base, args.candidate, absent, machines, chosen)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "base": args.base,
            "base_chosen": chosen or "given (--base)",
            "candidate": args.candidate,
            "method": args.method,
            "tolerance": args.tolerance,
            "verdicts": config_verdicts(rows),
            "not_evaluated": absent,
            "replaces": rule(config_verdicts(rows), absent)[0],
            "decoder_alone": machines,
        }
        write_json(out.with_suffix(".json"), {"meta": meta, "rows": rows}, indent=1)
        write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
