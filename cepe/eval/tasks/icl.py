"""In-context learning (§6, App. C.2): classification by label likelihood.

Each test input is scored with every label; the prediction maximises one of four scores (log-likelihood,
length-normalised, calibrated with domain-conditional PMI against the empty string, both). Demonstrations
are drawn from the training set balanced per label; ``decoder_demos`` (paper 2) precede the test input in
the decoder and ``k'`` more go to the CEPE encoder, one per chunk. ``full`` puts all ``2 + k'`` in the
decoder (the oracle), ``truncated`` only the 2, ``replug`` mixes one pass per encoder demonstration.

Data: BBC News here; the PCW-style datasets (SST-2, AG News, TREC, ...) as JSONL/CSV/TSV with text and
label columns (:func:`read_labelled`).
"""

from __future__ import annotations

import csv
import functools
import json
import random
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cepe.eval.common import EvalSetup, iter_source, limit_items, run_examples, text_key
from cepe.eval.methods import Request
from cepe.eval.metrics import SCORING_VARIANTS, label_scores


def read_labelled(
    path: str | Path,
    text_field: str = "text",
    label_field: str = "label",
    label_names: dict | list | None = None,
) -> list[dict[str, str]]:
    """Rows ``{"text", "label"}`` from JSONL, JSON list, CSV or TSV (with a header row).

    ``label_names`` maps raw labels (e.g. ``0``/``1``) to verbalisers (``negative``/``positive``), as a
    dict or a list indexed by the integer label.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"classification file {p} does not exist")
    name = p.name.lower()
    if name.endswith((".csv", ".tsv")):
        with open(p, newline="", encoding="utf-8") as f:
            raw = list(csv.DictReader(f, delimiter="\t" if name.endswith(".tsv") else ","))
    else:
        text = p.read_text(encoding="utf-8")
        raw = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(x) for x in text.splitlines() if x.strip()]
        )
    rows = []
    for i, r in enumerate(raw):
        if text_field not in r or label_field not in r:
            raise ValueError(
                f"{p}: row {i} lacks {text_field!r} or {label_field!r} (fields: {sorted(r)}); set text_field / label_field"
            )
        label = r[label_field]
        if label_names is not None:
            label = (
                label_names[int(label)]
                if isinstance(label_names, list)
                else label_names.get(label, label_names.get(str(label), label))
            )
        rows.append({"text": str(r[text_field]), "label": str(label)})
    return rows


def balanced_demos(
    train: list[dict[str, str]], count: int, seed: int, exclude: Collection[bytes] = ()
) -> list[dict[str, str]]:
    """``count`` demonstrations cycling through the labels (label order shuffled each round) so that every
    prefix is balanced up to remainders; examples drawn without replacement. An example whose text key
    (:func:`cepe.eval.common.text_key`) is in ``exclude`` (the queries' own texts: a source may hold
    copies of one article under two ids) is passed over; the draws are otherwise the same."""
    rng = random.Random(seed)
    by_label: dict[str, list[dict[str, str]]] = {}
    for r in train:
        by_label.setdefault(r["label"], []).append(r)
    for v in by_label.values():
        rng.shuffle(v)
    labels, out = sorted(by_label), []
    while len(out) < count and any(by_label.values()):
        order = labels[:]
        rng.shuffle(order)
        for lab in order:
            while exclude and by_label[lab] and text_key(by_label[lab][-1]["text"]) in exclude:
                by_label[lab].pop()
            if by_label[lab] and len(out) < count:
                out.append(by_label[lab].pop())
    return out


@dataclass
class Config:
    """Settings (paper: 250 test examples, 2 + {18, 38} demonstrations, 3 seeds).

    Attributes:
        train_path / test_path: labelled files; None = BBC News split by document hash.
        text_field, label_field, label_names: columns and verbalisers.
        template: one example, with ``{text}`` and ``{label}``; examples joined by ``separator``.
        max_text_tokens: truncate each input text (so a demonstration fits one encoder chunk).
        decoder_demos, encoder_demos: 2 and the list of k'.
        test_size, seeds.
        scoring: ``auto`` (the variant best for ``truncated``, as in the paper; a run without
            ``truncated`` runs it too, and reports it) or one of ll, ll_norm, pmi, pmi_norm.
        split: ``test`` (queries from the test part) or ``val``: queries from a ``val_fraction`` of the
            training part and demonstrations from the rest of it, never touching the test part (to choose
            between checkpoints or recipes; bundled source only).
    """

    train_path: str | None = None
    test_path: str | None = None
    text_field: str = "text"
    label_field: str = "label"
    label_names: dict | list | None = None
    source: dict[str, Any] = field(default_factory=lambda: {"corpus": "bbc"})
    test_fraction: float = 0.2
    template: str = "Article: {text}\nTopic: {label}"
    separator: str = "\n\n"
    max_text_tokens: int = 200
    decoder_demos: int = 2
    encoder_demos: list[int] = field(default_factory=lambda: [18, 38])
    test_size: int = 250
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    scoring: str = "auto"
    split: str = "test"
    val_fraction: float = 0.15


def _load(cfg: Config) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    if cfg.split not in ("test", "val"):
        raise ValueError(f"split must be 'test' or 'val', got {cfg.split!r}")
    if cfg.train_path and cfg.test_path:
        if cfg.split == "val":
            raise ValueError(
                "split 'val' carves queries from the bundled source's training part; with train_path / "
                "test_path files, give a validation file as test_path instead"
            )
        kw = {"text_field": cfg.text_field, "label_field": cfg.label_field, "label_names": cfg.label_names}
        return read_labelled(cfg.train_path, **kw), read_labelled(cfg.test_path, **kw)
    if cfg.train_path or cfg.test_path:
        raise ValueError("give both train_path and test_path, or neither (bundled BBC News)")
    from cepe.data.split import doc_hash

    train, test, val = [], [], []
    for d in iter_source(cfg.source):
        row = {"text": d["text"].strip(), "label": str(d[cfg.label_field])}
        if doc_hash(d["id"], 0) < cfg.test_fraction:
            test.append(row)
        elif cfg.split == "val" and doc_hash(d["id"], 1) < cfg.val_fraction:
            val.append(row)
        else:  # demonstrations, in source order
            train.append(row)
    return train, (val if cfg.split == "val" else test)


@dataclass
class _Prompt:
    """Token ids of the template's pieces: an example is ``head + text + tail + label``, a query the same
    without the label (scored as each of ``label_ids``); examples are joined by ``sep``."""

    setup: EvalSetup
    cfg: Config
    head: list[int]
    tail: list[int]
    label_prefix: str  # "Topic: {label}": the space before the label goes with it
    post: str
    label_ids: list[list[int]]
    sep: list[int]

    @classmethod
    def build(cls, setup: EvalSetup, cfg: Config, labels: list[str]) -> _Prompt:
        t = cfg.template
        if t.count("{text}") != 1 or t.count("{label}") != 1 or t.index("{text}") > t.index("{label}"):
            raise ValueError(
                f"the ICL template must hold {{text}} once and then {{label}} once (the label is what is "
                f'scored, after the text), e.g. "Article: {{text}}\nTopic: {{label}}"; got {t!r}'
            )
        pre, post = cfg.template.split("{label}", 1)
        strip = len(pre) - len(pre.rstrip())
        label_prefix = pre[len(pre.rstrip()) :] if strip else ""
        pre = pre.rstrip() if strip else pre
        return cls(
            setup=setup,
            cfg=cfg,
            head=setup.encode(pre.split("{text}")[0]),
            tail=setup.encode(pre.split("{text}", 1)[1]),
            label_prefix=label_prefix,
            post=post,
            label_ids=[setup.encode(label_prefix + lab + post) for lab in labels],
            sep=setup.encode(cfg.separator),
        )

    def text_ids(self, t: str) -> list[int]:
        enc = self.setup.encode
        return enc(self.setup.decode(enc(t)[: self.cfg.max_text_tokens]))

    def query_ids(self, r: dict[str, str]) -> list[int]:
        return self.head + self.text_ids(r["text"]) + self.tail

    def example_ids(self, r: dict[str, str]) -> list[int]:
        return self.query_ids(r) + self.setup.encode(self.label_prefix + r["label"] + self.post)


def _label_requests(method: str, prompt: _Prompt, dec: list[int], enc: list[list[int]], q: list[int]):
    """One request per label for test query ``q`` after the decoder demonstrations ``dec``, with the encoder
    demonstrations ``enc`` laid out as ``method`` reads them."""
    sep = prompt.sep
    if method in ("full", "streamingllm"):
        prefix = [t for e in enc for t in e + sep] + dec + q
        return [Request(prefix + ids, len(ids)) for ids in prompt.label_ids]
    if method == "cepe":
        return [Request(dec + q + ids, len(ids), [list(e) for e in enc]) for ids in prompt.label_ids]
    if method == "replug":  # each pass: one encoder demo, then the decoder prompt
        return [Request(dec + q + ids, len(ids), [e + sep for e in enc]) for ids in prompt.label_ids]
    return [Request(dec + q + ids, len(ids)) for ids in prompt.label_ids]


def _domain_scores(setup: EvalSetup, label_ids: list[list[int]]) -> Any:
    """Calibration: the log-likelihood of each label after the start token alone, the same for every
    method (the ``truncated`` method's decoder)."""
    from cepe.eval.methods import DecoderMethod

    base = setup.method("truncated") if "truncated" in setup.methods else None
    dm = base or DecoderMethod(setup.decoder, pad_token_id=setup.pad_id, autocast_dtype=setup.autocast_dtype)
    return dm.score([Request([setup.start_id, *ids], len(ids)) for ids in label_ids])


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    if cfg.scoring != "auto" and cfg.scoring not in SCORING_VARIANTS:
        raise ValueError(f"scoring must be 'auto' or one of {SCORING_VARIANTS}, got {cfg.scoring!r}")
    train, test_all = _load(cfg)
    labels = sorted({r["label"] for r in train})
    prompt = _Prompt.build(setup, cfg, labels)
    domain = _domain_scores(setup, prompt.label_ids)

    def classify(m, r, method, dec, enc):
        reqs = _label_requests(method, prompt, dec, enc, prompt.query_ids(r))
        scores = label_scores(m.score(reqs), domain)
        gold = labels.index(r["label"]) if r["label"] in labels else -1
        res: dict[str, Any] = {v: float(int(scores[v].argmax()) == gold) for v in SCORING_VARIANTS}
        res["_pred"] = {v: int(scores[v].argmax()) for v in SCORING_VARIANTS}
        return res, sum(x.num_tokens for x in reqs)

    # per (method, k'): accuracy % per scoring variant, one entry per seed, and the cost of the last seed
    acc: dict[tuple[str, int], dict[str, list[float]]] = {}
    methods = list(setup.methods)
    chooser = cfg.scoring == "auto" and "truncated" not in methods
    if (
        chooser
    ):  # auto takes truncated's best variant: run it, so a run's variant does not depend on its methods
        methods.append("truncated")
    for seed in cfg.seeds:
        rng = random.Random(seed)
        test = test_all[:]
        rng.shuffle(test)
        test = limit_items(test, cfg.test_size, setup)
        asked = {text_key(r["text"]) for r in test}  # no query among its own demonstrations
        demos = balanced_demos(train, cfg.decoder_demos + max(cfg.encoder_demos or [0]), seed, asked)
        dec = [t for d in demos[: cfg.decoder_demos] for t in prompt.example_ids(d) + prompt.sep]
        for kp in [0, *cfg.encoder_demos]:
            enc = [prompt.example_ids(d) for d in demos[cfg.decoder_demos : cfg.decoder_demos + kp]]
            for method in methods:
                if (kp == 0) != (method == "truncated"):
                    continue
                fn = functools.partial(classify, method=method, dec=dec, enc=enc)
                vals, cost = run_examples(setup, method, test, fn, f"icl seed={seed} k'={kp}")
                bucket = acc.setdefault((method, kp), {v: [] for v in SCORING_VARIANTS})
                for v in SCORING_VARIANTS:
                    bucket[v].append(100.0 * sum(x[v] for x in vals) / max(1, len(vals)))
                bucket.setdefault("_cost", []).append(cost)  # type: ignore[arg-type]
                preds = bucket.setdefault("_pred", {v: [0] * len(labels) for v in SCORING_VARIANTS})
                for x in vals:  # how often each label is predicted, over all seeds
                    for v in SCORING_VARIANTS:
                        preds[v][x["_pred"][v]] += 1  # type: ignore[index]
    variant = _scoring_variant(cfg.scoring, acc)
    return {
        "task": "icl",
        "rows": [_row(method, kp, b, variant, cfg, labels) for (method, kp), b in acc.items()],
        "plot_x": "k_encoder",
        "notes": [
            f"labels: {labels}",
            f"scoring variant: {variant} (ll_norm/pmi_norm divide by label tokens)",
            *(["truncated was added to the methods: scoring auto takes its best variant"] if chooser else []),
        ],
    }


def _scoring_variant(scoring: str, acc: dict[tuple[str, int], dict[str, list[float]]]) -> str:
    """``scoring``, or for ``auto`` the variant best for ``truncated`` (summed over seeds; the first of
    :data:`SCORING_VARIANTS` on a tie)."""
    if scoring != "auto":
        return scoring
    ref = acc[("truncated", 0)]  # run_icl runs it for auto
    return max(SCORING_VARIANTS, key=lambda v: sum(ref[v]))


def _row(
    method: str, kp: int, b: dict[str, list[float]], variant: str, cfg: Config, labels: list[str]
) -> dict[str, Any]:
    """A result row; ``predicted``: how often each label was the prediction (scoring ``variant``, all
    seeds), which shows a method that copies one label instead of classifying."""
    means = {v: sum(b[v]) / len(b[v]) for v in SCORING_VARIANTS}
    return {
        "method": method,
        "setting": {"k_decoder": cfg.decoder_demos, "k_encoder": kp},
        "metric": f"accuracy[{variant}]",
        "value": means[variant],
        "n": len(cfg.seeds),
        "variants": means,
        "predicted": dict(zip(labels, b["_pred"][variant])),  # type: ignore[call-overload]
        **b["_cost"][-1],  # type: ignore[dict-item]
    }
