"""Time the micro-batches of one optimizer step of a training config, as training runs them (forward,
backward, the stage's losses; no optimizer update), and say where the process's time went: wall seconds,
user and system CPU seconds, minor page faults and peak resident memory. For comparing what surrounds the
step (the allocator, thread settings) on the same examples; run it with the cores otherwise idle.

The first micro-batch runs once untimed (warm-up); then the step's micro-batches are timed once each.

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
    ap.add_argument("--step", type=int, default=5, help="the optimizer step whose examples are timed")
    ap.add_argument("--micro", type=int, default=None, help="time only the first N micro-batches")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--out", help="also write the result as JSON here")
    args = ap.parse_args(argv)

    import torch

    from cepe.training.config import load_config
    from cepe.training.data import collate, example_indices, regroup_chunks, step_chunk_length, step_layout
    from cepe.training.runctl import decide_bf16
    from cepe.training.trainer import _build_modules, example_maker

    cfg = load_config(args.config, overrides=args.set)
    if cfg.stage == "mlm":
        raise SystemExit("step_time times CEPE stages (warmup, cepe, ceped), not mlm")
    torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
    use_bf16 = decide_bf16(cfg.bf16, torch.device("cpu"), 1)
    model, _, module = _build_modules(cfg, use_bf16)
    make = example_maker(cfg, model)
    accum = cfg.batch_size // cfg.micro_batch_size
    batches = []
    for micro in range(accum if args.micro is None else min(args.micro, accum)):
        idx = example_indices(args.step, cfg.batch_size, micro, cfg.micro_batch_size, 0, 1)
        batch = collate([make(i, *step_layout(cfg, args.step, micro)) for i in idx])
        batch.pop("index")
        length = step_chunk_length(cfg, args.step, micro)
        batches.append(regroup_chunks(batch, length) if length is not None else batch)

    def run(batch: dict) -> None:
        loss, _ = module(batch)
        loss.backward()
        module.release()

    run(batches[0])
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for batch in batches:
        run(batch)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "config": args.config,
        "step": args.step,
        "micro_batches": len(batches),
        "encoder_shapes": [list(b["encoder_input_ids"].shape) for b in batches],
        "bf16": use_bf16,
        "threads": torch.get_num_threads(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "malloc_conf": os.environ.get("MALLOC_CONF", ""),
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
