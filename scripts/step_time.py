"""Time the micro-batches of one optimizer step of a training config, as training runs them (forward,
backward, the stage's losses; no optimizer update), and say where the process's time went: wall seconds,
user and system CPU seconds, minor page faults and peak resident memory. For comparing what surrounds the
step (the allocator, thread settings) on the same examples; run it with the cores otherwise idle.

The first micro-batch runs once untimed (warm-up); then the step's micro-batches are timed once each
(``--steps N``: N consecutive steps', with each step's wall time and the resident memory after it).

Usage: python scripts/step_time.py CONFIG [--step 5] [--micro 2] [--set KEY=VALUE ...] [--out OUT.json]
e.g.   python scripts/step_time.py configs/train/recipe/read_lm6.yaml --step 5 \
           --set init_adapter=runs/recipe/read_lm5/checkpoints/step_000300/adapter
       LD_PRELOAD=... MALLOC_CONF=... python scripts/step_time.py ...   (the same with another allocator)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument(
        "--step",
        type=int,
        default=5,
        help="the optimizer step whose examples are timed, counted from 0 (the log's step N is N - 1 here)",
    )
    ap.add_argument("--micro", type=int, default=None, help="time only the first N micro-batches")
    ap.add_argument(
        "--steps", type=int, default=1, help="time this many consecutive steps from --step (memory over time)"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument(
        "--no-purge",
        action="store_true",
        help="do not purge jemalloc's kept pages after each step, as training does",
    )
    ap.add_argument("--out", help="also write the result as JSON here")
    args = ap.parse_args(argv)

    import torch

    from cepe.alloc import purge
    from cepe.training.config import load_config
    from cepe.training.runctl import decide_bf16
    from cepe.training.trainer import _build_modules, example_maker, micro_batch

    cfg = load_config(args.config, overrides=args.set)
    if cfg.stage == "mlm":
        raise SystemExit("step_time times CEPE stages (warmup, cepe, ceped), not mlm")
    torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
    use_bf16 = decide_bf16(cfg.bf16, torch.device("cpu"), 1)
    model, _, module = _build_modules(cfg, use_bf16)
    make = example_maker(cfg, model)
    accum = cfg.batch_size // cfg.micro_batch_size
    micros = accum if args.micro is None else min(args.micro, accum)
    steps = range(args.step, args.step + args.steps)
    batches = [(step, micro_batch(cfg, make, step, micro)) for step in steps for micro in range(micros)]

    def run(batch: dict) -> None:
        loss, _ = module(batch)
        loss.backward()
        module.release()

    def rss_gib() -> float:  # resident now (the peak is ru_maxrss)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30

    run(batches[0][1])
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    per_step: dict[int, float] = {}
    rss_after: dict[int, float] = {}
    for n, (step, batch) in enumerate(batches):
        t = time.perf_counter()
        run(batch)
        if not args.no_purge and (n + 1 == len(batches) or batches[n + 1][0] != step):
            purge()  # the step's end, as training does it
        per_step[step] = per_step.get(step, 0.0) + time.perf_counter() - t
        rss_after[step] = round(rss_gib(), 2)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "config": args.config,
        "step": args.step,
        "micro_batches": len(batches),
        "steps": args.steps,
        "encoder_shapes": [list(b["encoder_input_ids"].shape) for _, b in batches],
        "step_wall_s": [round(v, 2) for v in per_step.values()],
        "rss_gib_after_each_step": list(rss_after.values()),
        "bf16": use_bf16,
        "threads": torch.get_num_threads(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "malloc_conf": os.environ.get("MALLOC_CONF", ""),
        "purged_each_step": not args.no_purge,
        "wall_s": round(wall, 2),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "system_s": round(after.ru_stime - before.ru_stime, 2),
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "peak_rss_gib": round(after.ru_maxrss / 2**20, 2),
    }
    print(json.dumps(result))
    if args.out:
        from pathlib import Path

        from cepe.fileio import write_json

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
