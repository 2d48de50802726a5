#!/usr/bin/env bash
# How well does an adapter read its context as a function of the encoder's chunk length? The validation
# needle with its answer's teacher-forced NLL (configs/eval/needle_val_nll.yaml: Austen's test split, its own
# needle), the same haystacks and depths cut into chunks of each length. Validation data only.
# Usage: bash scripts/chunk_length_sweep.sh ADAPTER_DIR OUT_DIR [LENGTH ...]   (default 64 128 256)
# Writes OUT_DIR/chunk_L/needle/ and OUT_DIR/chunk_length.{json,md}. Pause a training run first.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ADAPTER=$1; OUT=$2; shift 2
LENGTHS=("$@"); [ ${#LENGTHS[@]} -gt 0 ] || LENGTHS=(64 128 256)
for n in "${LENGTHS[@]}"; do
  d=$OUT/chunk_$n/needle
  [ -f "$d/needle.json" ] || cepe eval needle --model "$ADAPTER" --config configs/eval/needle_val_nll.yaml \
    --set "chunk_length=$n" --methods cepe --autocast bf16 --no-progress --out "$d" > /dev/null
  echo "chunk length $n done"
done
python - "$OUT" "$ADAPTER" "${LENGTHS[@]}" <<'PY'
import json, sys
out, adapter, lengths = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = []
for n in lengths:
    needle = json.load(open(f"{out}/chunk_{n}/needle/needle.json"))["rows"]
    row = {"chunk_length": int(n)}
    for total in sorted({r["setting"]["total"] for r in needle}):
        cells = [r for r in needle if r["setting"]["total"] == total]
        row[f"needle_{total}"] = sum(r["value"] for r in cells) / len(cells)
        row[f"needle_nll_{total}"] = sum(r["answer_nll"] for r in cells) / len(cells)
    rows.append(row)
with open(f"{out}/chunk_length.json", "w") as f:
    json.dump({"adapter": adapter, "config": "configs/eval/needle_val_nll.yaml", "rows": rows}, f, indent=1)
keys = list(rows[0])
lines = [f"# Validation needle by chunk length: {adapter}", "", "| " + " | ".join(keys) + " |",
         "|" + "---|" * len(keys)]
lines += ["| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
          for r in rows]
open(f"{out}/chunk_length.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
