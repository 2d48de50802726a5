import math

import pytest
import torch

from cepe.eval import metrics as M


def test_normalize_and_em():
    assert M.normalize_answer("  The Eiffel-Tower!  ") == "eiffeltower"
    assert M.normalize_answer("An apple, a pear") == "apple pear"
    assert M.exact_match("the Paris.", ["London", "paris"]) == 1.0
    assert M.exact_match("Paris France", "Paris") == 0.0


def test_f1_hand_computed():
    # pred tokens: [big, red, dog]; gold: [red, dog, barked] -> 2 common, P=2/3, R=2/3, F1=2/3
    assert M.token_f1("a big red dog", "The red dog barked") == pytest.approx(2 / 3)
    assert M.token_f1("cat", ["dog", "cat"]) == 1.0
    assert M.token_f1("", "x") == 0.0


def test_rouge_l_hand_computed():
    # pred: the cat sat on the mat (6); ref: the cat lay on the mat (6); LCS = the cat on the mat (5)
    assert M.rouge_l("The cat sat on the mat", "the cat lay on the mat.") == pytest.approx(5 / 6)
    # pred 2 tokens, ref 4 tokens, LCS 2: P=1, R=1/2, F=2/3
    assert M.rouge_l("a b", "a x b y") == pytest.approx(2 / 3)
    assert M.rouge_l("q", "z") == 0.0


def test_contains_and_lookup():
    assert M.contains_answer("I think it is Dolores Park, yes", "dolores park") == 1.0
    assert M.text_metric("rouge_l") is M.rouge_l
    with pytest.raises(ValueError, match="unknown metric"):
        M.text_metric("bleu")


def test_perplexity():
    assert M.perplexity(2 * math.log(4.0), 2) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        M.perplexity(1.0, 0)


def test_label_scores_calibrated_hand_computed():
    # label A: 1 token logp -1 given prompt, -3 given domain; label B: 2 tokens -0.5, -0.7 vs -0.2, -0.2
    cond = [torch.tensor([-1.0]), torch.tensor([-0.5, -0.7])]
    dom = [torch.tensor([-3.0]), torch.tensor([-0.2, -0.2])]
    s = M.label_scores(cond, dom)
    assert s["ll"].tolist() == pytest.approx([-1.0, -1.2])
    assert s["ll_norm"].tolist() == pytest.approx([-1.0, -0.6])
    assert s["pmi"].tolist() == pytest.approx([2.0, -0.8])
    assert s["pmi_norm"].tolist() == pytest.approx([2.0, -0.4])
    # ll prefers A, ll_norm prefers B, calibrated prefers A
    assert int(s["ll"].argmax()) == 0 and int(s["ll_norm"].argmax()) == 1 and int(s["pmi"].argmax()) == 0
