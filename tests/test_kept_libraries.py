"""Where a kept library replaced hand-written code, it gives today's numbers; where it could not, why."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cepe.eval.metrics import rouge_l


def _rouge_l_before(prediction, answers):
    """The hand-written ROUGE-L that ``rouge-score`` replaced (kept here to compare)."""

    def toks(t):
        return re.findall(r"[a-z0-9]+", t.lower())

    def lcs(a, b):
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0] * (len(b) + 1)
            for j, y in enumerate(b, start=1):
                cur[j] = prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1])
            prev = cur
        return prev[-1]

    best = 0.0
    for g in [answers] if isinstance(answers, str) else answers:
        p_, r_ = toks(prediction), toks(g)
        n = lcs(p_, r_) if p_ and r_ else 0
        if n:
            p, r = n / len(p_), n / len(r_)
            best = max(best, 2 * p * r / (p + r))
    return best


CASES = [
    ("The cat sat on the mat.", "the cat is on the mat"),
    ("Paris", ["paris, France", "The capital is Paris"]),
    ("", "anything"),
    ("no overlap here", "something else"),
    ("Ünïcode café, 3.14 — numbers 42!", "cafe 3 14 numbers 42"),
    ("a b c d e f", ["f e d c b a", "a c e", "b d f g"]),
    ("It was the best of times, it was the worst of times", "it was the age of wisdom, it was the age"),
    ("Don't stop-believing", "dont stop believing"),
]


@pytest.mark.parametrize("prediction,answers", CASES)
def test_rouge_score_gives_the_numbers_of_the_hand_written_rouge_l(prediction, answers):
    assert rouge_l(prediction, answers) == pytest.approx(_rouge_l_before(prediction, answers), abs=1e-12)


def test_no_transformers_schedule_has_our_per_step_factors():
    """Why ``cosine_schedule`` stays hand-written (see its docstring)."""
    import transformers

    from cepe.training.trainer import cosine_schedule

    steps, warmup_ratio, floor = 50, 0.1, 0.1
    warmup = math.ceil(warmup_ratio * steps)

    def factors(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = make(opt)
        out = []
        for _ in range(steps):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    ours = factors(lambda o: cosine_schedule(o, steps, warmup_ratio, floor))
    expected = [
        (s + 1) / warmup
        if s < warmup
        else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
        for s in range(steps)
    ]
    assert ours == pytest.approx(expected, abs=1e-12)
    theirs = [
        lambda o: transformers.get_cosine_schedule_with_warmup(o, warmup, steps),
        lambda o: transformers.get_cosine_with_min_lr_schedule_with_warmup(
            o, warmup, steps, min_lr_rate=floor
        ),
        lambda o: transformers.get_cosine_with_min_lr_schedule_with_warmup_lr_rate(
            o, warmup, steps, min_lr_rate=floor
        ),
    ]
    for make in theirs:
        assert factors(make) != pytest.approx(ours, abs=1e-9)


def test_one_markdown_table_helper():
    from cepe.tables import pipe_table

    assert pipe_table(["a", "b"], [[1, "x"], [2.5, True]]) == [
        "| a | b |",
        "|---|---|",
        "| 1 | x |",
        "| 2.5 | True |",
    ]


def test_matmul_peak_is_timed_by_torch_utils_benchmark():
    from cepe.bench.runner import matmul_peak_flops

    assert matmul_peak_flops(64, torch.float32, 0.05) > 0
    assert matmul_peak_flops(64, torch.float32, 0.05, torch.device("cpu")) > 0
    # the operands live on the device asked for (training on an accelerator measures the accelerator)
    with pytest.raises((RuntimeError, ValueError)):
        matmul_peak_flops(64, torch.float32, 0.05, "no_such_device")
