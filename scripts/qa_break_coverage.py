"""How many planted-fact answers ``qa_line_break`` can break with the default tokenizer (docs/TRAINING.md,
"Answers that break their line"): facts from the ``qa`` examples' generators (``make_fact``, every third
one two clauses by ``compound_fact``; span facts are left out); an answer that cannot be broken token
for token stays whole in training.

Usage: python scripts/qa_break_coverage.py [N]   (default 300 facts, seed 0)
"""

import random
import sys

from cepe.assets import load_tokenizer
from cepe.training.synthetic_qa import broken_answer, compound_fact, make_fact


def main(n: int = 300) -> None:
    tok, r, broken = load_tokenizer(), random.Random(0), 0
    for i in range(n):
        fact = make_fact(r)
        if i % 3 == 0:
            fact = compound_fact(fact, make_fact(r))
        ids = tok.encode(fact.fact, add_special_tokens=False)
        broken += broken_answer(tok, fact.fact, ids, r) is not None
    print(f"{broken} of {n} answers can be broken ({100 * broken / n:.0f} %)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
