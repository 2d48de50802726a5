"""lm-evaluation-harness `cepe` model vs `cepe eval lm` on the same essays (fp32, shipped adapter).

Usage: python scripts/harness_vs_lm.py TASK_DIR   (TASK_DIR from `cepe-lm-eval write-tasks`)
Prints the harness's perplexity metrics, then per essay the perplexity of its last 256 tokens scored by
the harness model and by `cepe eval lm` (total = the essay's length, decoder window 512, chunks 64).
"""

import json
import math
import sys

import lm_eval
from lm_eval.tasks import TaskManager

from cepe.eval import harness
from cepe.eval.api import load_setup, run_task


def main(tasks_dir: str) -> None:
    with open(f"{tasks_dir}/cepe_ppl.jsonl", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    setup = load_setup("adapters/smollm2-135m-cepe", ["cepe"], progress=False, batch_size=1)
    lm = harness.CepeLM(setup=setup, method="cepe", decoder_window=512, rolling_tokens=256)
    tm = TaskManager(include_path=tasks_dir, include_defaults=False)
    res = lm_eval.simple_evaluate(model=lm, tasks=["cepe_ppl"], task_manager=tm)["results"]["cepe_ppl"]
    print("lm_eval cepe_ppl:", {k: v for k, v in res.items() if k.endswith(",none")})
    diffs = []
    for i, text in enumerate(docs):
        req = lm.rolling_requests(text)[-1]
        nll_h = -float(setup.method("cepe").score([req])[0].sum())
        n = len(setup.encode(text))
        cfg = {
            "sources": [{"name": "d", "documents": [{"id": f"d{i}", "text": text}]}],
            "totals": [n],
            "decoder_window": 512,
            "decoder_window_overrides": {},
            "eval_tokens": 256,
            "chunk_length": 64,
            "sequences_per_domain": 1,
        }
        ppl = next(x["value"] for x in run_task("lm", setup, cfg)["rows"] if x["setting"]["domain"] == "d")
        nll_lm = 256 * math.log(ppl)
        diffs.append(abs(nll_h - nll_lm) / nll_lm)
        print(
            f"doc {i}: {n} tokens, last-256 PPL harness {math.exp(nll_h / 256):.4f} vs cepe eval lm {ppl:.4f}"
        )
    print("max relative NLL difference", max(diffs))


if __name__ == "__main__":
    main(sys.argv[1])
