#!/usr/bin/env bash
# Validation evaluations under glibc's malloc and under jemalloc (scripts/fast_alloc.sh), in alternated
# pairs: each process's wall and CPU seconds, peak memory and page faults (GNU time), and whether every
# value the two allocators gave is the same.
# Usage: bash scripts/eval_alloc_ab.sh ADAPTER_DIR OUT_DIR [PAIRS]   (default 2 pairs; pause any training
# run on the same cores). ONLY="lm_val copy_val" (the default) names the validation configs, as in eval_val.sh.
# Writes OUT_DIR/times.md and OUT_DIR/times.json; each run's results under OUT_DIR/ALLOC_N/CONFIG/.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
[ $# -ge 2 ] || { echo "usage: bash scripts/eval_alloc_ab.sh ADAPTER_DIR OUT_DIR [PAIRS]" >&2; exit 2; }
ADAPTER=$1; OUT=$2; PAIRS=${3:-2}
TIME=${GNU_TIME:-/usr/bin/time}
[ -x "$TIME" ] || { echo "GNU time ($TIME) is needed: apt-get install time, or GNU_TIME=PATH" >&2; exit 2; }
JE=$(env -u LD_PRELOAD -u CEPE_MALLOC bash -c '. scripts/fast_alloc.sh 2>/dev/null; echo "${LD_PRELOAD:-}"')
[ -n "$JE" ] || { echo "no libjemalloc.so.2 here (apt-get install libjemalloc2): nothing to compare" >&2; exit 2; }
mkdir -p "$OUT"
: > "$OUT/times.tsv"
for ((i = 1; i <= PAIRS; i++)); do
  for alloc in system jemalloc; do
    for name in ${ONLY:-lm_val copy_val}; do
      # eval_val.sh preloads jemalloc itself (scripts/fast_alloc.sh) unless CEPE_MALLOC=system
      "$TIME" -o "$OUT/time.tmp" -f "%e	%U	%S	%M	%R" env -u LD_PRELOAD -u MALLOC_CONF \
        CEPE_MALLOC="$([ "$alloc" = system ] && echo system)" ONLY="$name" \
        bash scripts/eval_val.sh "$ADAPTER" "$OUT/${alloc}_$i" > /dev/null
      printf '%s\t%s\t%s\t%s\n' "$alloc" "$i" "$name" "$(cat "$OUT/time.tmp")" >> "$OUT/times.tsv"
      echo "$alloc $i $name: $(cut -f1 "$OUT/time.tmp") s"
    done
  done
done
rm -f "$OUT/time.tmp"
python - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for line in (out / "times.tsv").read_text().splitlines():
    alloc, pair, name, wall, user, sys_s, rss_kb, faults = line.split("\t")
    rows.append({"allocator": alloc, "pair": int(pair), "config": name, "wall_s": float(wall), "user_s": float(user),
                 "system_s": float(sys_s), "peak_gib": round(int(rss_kb) / 2**20, 2), "page_faults": int(faults)})


def values(run: Path) -> list:
    return [[r.get("setting"), r.get("metric"), r.get("value")] for f in sorted(run.glob("*.json")) for r in json.loads(f.read_text())["rows"]]


same = {name: len({json.dumps(values(out / f"{r['allocator']}_{r['pair']}" / name)) for r in rows if r["config"] == name}) == 1
        for name in {r["config"] for r in rows}}
(out / "times.json").write_text(json.dumps({"rows": rows, "same_values": same}, indent=1) + "\n")
lines = ["| allocator | pair | config | wall s | user s | system s | peak GiB | page faults |", "|---|---|---|---|---|---|---|---|"]
lines += [f"| {r['allocator']} | {r['pair']} | {r['config']} | {r['wall_s']:.2f} | {r['user_s']:.2f} | {r['system_s']:.2f} | {r['peak_gib']} | {r['page_faults']:,} |" for r in rows]
lines += ["", "Every value the same under both allocators: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in sorted(same.items()))]
(out / "times.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
