"""Synthetic question answering from the encoder: facts planted in the context, a question in the decoder.

The ``qa`` examples of a mixed CEPE stage (:func:`cepe.training.data.mixed_example`) teach the adapter to
answer from what it reads, not only to continue it: one to four generated facts ("Mara Lindqvist was born in
Tallinn.") are planted at random places of the encoder's text; the decoder holds the end of
the window's own text, then a question about one of the facts, in the decoder's chat template when it has
one, and the answer, which restates the fact. Only the answer is scored, and each answer token that
repeats a fact token gets that token's encoder position as its attention target.

Facts are drawn from small word lists by a seeded ``random.Random``: entity × relation × value gives
millions of combinations, so answers cannot be memorised. None of the templates is an evaluation's: the
QA and RULER tasks plant "The <attribute> of <person> is <value>." (favourite colour, home town, pet,
lucky number) and the needle tasks their own sentences; no training fact has that form or those
attributes (a test checks it).

Shape legend: K chunks, L chunk length, n decoder tokens.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import torch

FIRST = (
    "Mara Jonas Ilse Tomas Wren Odile Priya Kofi Anselm Yuki Dario Lena Hugo Nadia Emil Sanna Oskar Rhea "
    "Teodor Ines Felix Amara Bruno Clio Ravi Esme Lucan Mireille Tobias Zora Idris Hana Viggo Noor Caspar "
    "Greta Matteo Sibyl Rafael Ottilie"
).split()
LAST = (
    "Lindqvist Okafor Brandt Moreau Castellanos Nakamura Halloran Petrescu Varga Olsen Delacroix Abernathy "
    "Kowalczyk Ferreira Hartmann Quist Salazar Yilmaz Eriksen Dubois Mbeki Novak Rasmussen Thorne Vidal "
    "Achterberg Lindgren Sato Oyelaran Beaumont"
).split()
THINGS = (
    "lighthouse observatory bakery library greenhouse workshop museum orchard vineyard harbour bridge "
    "monastery laboratory theatre garden mill archive"
).split()
PLACES = (
    "Tallinn Porto Ghent Bergen Lucerne Cusco Hobart Kraków Valparaíso Tromsø Zanzibar Galway Kyoto Fez "
    "Ljubljana Quebec Tbilisi Oaxaca Dunedin Bruges"
).split()
COLORS = "crimson teal amber violet ochre indigo emerald scarlet cobalt ivory maroon turquoise".split()
FOODS = (
    "lentil soup plum dumplings smoked trout saffron rice walnut bread fig jam roasted chestnuts "
    "lemon cake barley stew apricot tart"
).split()
FOODS = [" ".join(FOODS[i : i + 2]) for i in range(0, len(FOODS), 2)]
OBJECTS = (
    "a brass compass|a green umbrella|an old violin|a silver key|a wooden chess set|a red notebook|"
    "a glass marble|a paper kite|a copper kettle|a blue scarf|a pocket watch|a clay pot"
).split("|")


@dataclass
class Fact:
    """One planted fact: its sentence and the question about it (the answer restates the sentence)."""

    fact: str
    question: str


def _person(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def _number(r: random.Random) -> str:
    return str(r.randint(10**3, 10**7 - 1))


NUM_TEMPLATES = 12


def make_fact(
    r: random.Random, templates: int = NUM_TEMPLATES, person: str | None = None, thing: str | None = None
) -> Fact:
    """A random fact of one of the first ``templates`` templates, with its question; the answer repeats
    the fact word for word. (The first six are the ones ``long_mixed_qa`` began with.) ``person`` and
    ``thing`` ("the mill in Fez"): whom or what a fact about someone or a place names (default: drawn)."""
    kind = r.randrange(templates)
    p = _person(r) if person is None else person
    if kind >= 6:
        return _more_facts(kind, p, r, thing)
    if kind == 0:
        v = r.choice(PLACES)
        s = f"{p} was born in {v}."
        return Fact(s, f"Where was {p} born?")
    if kind == 1:
        v = r.choice(COLORS)
        s = f"{p} painted the front door {v}."
        return Fact(s, f"What colour did {p} paint the front door?")
    if kind == 2:
        thing = f"the {r.choice(THINGS)} in {r.choice(PLACES)}" if thing is None else thing
        v = _number(r)
        s = f"The access code for {thing} is {v}."
        return Fact(s, f"What is the access code for {thing}?")
    if kind == 3:
        v = r.choice(FOODS)
        s = f"Every Sunday {p} cooks {v}."
        return Fact(s, f"What does {p} cook every Sunday?")
    if kind == 4:
        v = r.choice(OBJECTS)
        s = f"{p} keeps {v} in the attic."
        return Fact(s, f"What does {p} keep in the attic?")
    v = _number(r)
    s = f"{p} owns {v} books."
    return Fact(s, f"How many books does {p} own?")


SHIPS = "Albatross Meridian Wayfarer Kestrel Northwind Halcyon Seraphine Corvid Tideline Marigold".split()


def _more_facts(kind: int, p: str, r: random.Random, thing: str | None = None) -> Fact:
    """Facts whose subject is not a person, or whose answer starts with a name that must be read."""
    place, other = r.sample(PLACES, 2)
    thing = f"the {r.choice(THINGS)} in {place}" if thing is None else thing
    Thing = "T" + thing[1:]
    if kind == 6:
        s = f"{Thing} opens at {r.randint(5, 11)} o'clock."
        return Fact(s, f"At what time does {thing} open?")
    if kind == 7:
        color = r.choice(COLORS)
        s = f"The password for the {color} safe is {_number(r)}."
        return Fact(s, f"What is the password for the {color} safe?")
    if kind == 8:
        s = f"The ferry from {place} to {other} leaves every {r.choice((10, 15, 20, 30, 40, 45))} minutes."
        return Fact(s, f"How often does the ferry from {place} to {other} leave?")
    if kind == 9:
        s = f"Each spring the festival in {place} celebrates {r.choice(FOODS)}."
        return Fact(s, f"What does the festival in {place} celebrate each spring?")
    if kind == 10:
        s = f"{Thing} was built in {r.randint(1200, 1990)}."
        return Fact(s, f"When was {thing} built?")
    ship = r.choice(SHIPS)
    s = f"{p} is the captain of the ship {ship}."
    return Fact(s, f"Who is the captain of the ship {ship}?")


def compound_fact(first: Fact, second: Fact) -> Fact:
    """One sentence of two clauses: ``first``'s fact, ", and ", then ``second``'s (its opening word in lower
    case unless it is a name); the question is ``first``'s, so the answer restates the whole sentence and
    goes on past the clause that answers it, as a needle's answer does."""
    head, rest = second.fact.split(" ", 1)
    if head not in FIRST:
        head = head.lower()
    return Fact(f"{first.fact.rstrip('.')}, and {head} {rest}", first.question)


SPAN_TOKENS = (3, 10)


def make_span_fact(r: random.Random, value: str, person: str | None = None) -> Fact:
    """A fact whose value is ``value``, a span of real text: no word list to choose from, so answering
    means copying whatever the context holds (as a needle's free-form value asks); ``person`` as in
    :func:`make_fact`. None of these templates starts with "The", so none can take the evaluations' "The
    <attribute> of <person> is"."""
    p = _person(r) if person is None else person
    thing = f"the {r.choice(THINGS)} in {r.choice(PLACES)}"
    kind = r.randrange(5)
    if kind == 0:
        return Fact(
            f"{p} wrote on the back of a postcard: {value}.", f"What did {p} write on the back of a postcard?"
        )
    if kind == 1:
        return Fact(
            f'Carved over the gate of {thing} are the words "{value}".',
            f"What words are carved over the gate of {thing}?",
        )
    if kind == 2:
        return Fact(
            f'On the night train {p} kept repeating "{value}".',
            f"What did {p} keep repeating on the night train?",
        )
    if kind == 3:
        return Fact(f"A telegram to {p} said only: {value}.", f"What did the telegram to {p} say?")
    return Fact(
        f'Under the clock of {thing} someone had scratched "{value}".',
        f"What had someone scratched under the clock of {thing}?",
    )


def decoy_fact(
    asked: Fact, r: random.Random, stream: list[int], tok: Any, span_tokens: tuple[int, int] = SPAN_TOKENS
) -> Fact | None:
    """Another fact that opens with ``asked``'s first two words (the same name, or the same template's
    words: "The access code ...", "A telegram ...") but says something else, about which another question
    is asked: an answer's opening that stands in the encoder more than once, as a needle's opening words
    stand all over a haystack. Drawn from both fact families (word lists and spans of ``stream``); None
    where 96 draws found none."""
    head = asked.fact.split()
    words = head[:2]
    person = " ".join(words) if len(words) == 2 and words[0] in FIRST and words[1] in LAST else None
    thing = "the " + " ".join(head[1:4]) if head[:1] == ["The"] and head[1:2] and head[1] in THINGS else None
    for i in range(96):
        if i % 2:
            value = span_value(stream, r, tok, span_tokens)
            fact = make_span_fact(r, value, person) if value else None
        else:
            fact = make_fact(r, person=person, thing=thing)
        if (
            fact is not None
            and fact.fact.split()[:2] == words
            and fact.question != asked.question
            and fact.fact != asked.fact
        ):
            return fact
    return None


def window_decoy_line(
    asked: Fact, r: random.Random, stream: list[int], tok: Any, span_tokens: tuple[int, int] = SPAN_TOKENS
) -> str | None:
    """``"\n\n"`` and a line that opens with ``asked``'s first one or two words and goes on with a few
    words of ``stream`` (:func:`span_value`), not the fact itself: the last line of the decoder's own text,
    where it offers the answer's opening another continuation. None where 8 draws found none."""
    words = asked.fact.split()
    for _ in range(8):
        opening = " ".join(words[: r.randint(1, min(2, len(words)))])
        value = span_value(stream, r, tok, span_tokens)
        if value is None:
            continue
        line = f"{opening} {value}."
        if not asked.fact.startswith(line.rstrip(".")):  # not the fact itself, nor its beginning
            return "\n\n" + line
    return None


def span_value(
    stream: list[int], r: random.Random, tok: Any, tokens: tuple[int, int] = SPAN_TOKENS
) -> str | None:
    """``tokens`` = ``(min, max)`` tokens of ``stream`` at a random place, as one line of text (None if
    nothing readable)."""
    k = r.randint(*tokens)
    at = r.randrange(0, max(1, len(stream) - k))
    for j in range(at, min(at + 8, len(stream) - k)):  # start at a word's start where one is near
        if tok.decode(stream[j : j + 1]).startswith(" "):
            at = j
            break
    text = " ".join(tok.decode(stream[at : at + k]).replace('"', " ").split()).strip(" .")
    return text if sum(c.isalnum() for c in text) >= 3 else None


class ByteCodec:
    """A tokenizer stand-in for tiny random decoders (ids = UTF-8 bytes); needs a vocabulary of 256."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=4)
def _tokenizer(decoder: str, tiny_vocab: int | None) -> Any:
    if tiny_vocab is not None:
        if tiny_vocab < 256:
            raise ValueError(
                f"qa examples on a tiny decoder spell text in bytes and need vocab_size >= 256, got {tiny_vocab}"
            )
        return ByteCodec()
    from cepe.assets import load_tokenizer

    return load_tokenizer(decoder)


def text_tokenizer(decoder: str, tiny_vocab: int | None = None) -> Any:
    """The tokenizer synthetic examples spell their text with: the decoder's, or :class:`ByteCodec` for a
    tiny random decoder (``tiny_vocab`` >= 256)."""
    return _tokenizer(decoder, tiny_vocab)


@functools.lru_cache(maxsize=4)
def _chat_parts(decoder: str, tiny_vocab: int | None) -> tuple[list[int], list[int]]:
    """Token ids before and after the user's message in the decoder's chat template (empty without one)."""
    tok = _tokenizer(decoder, tiny_vocab)
    if not getattr(tok, "chat_template", None):
        return [], []
    marker = "\x00BODY\x00"
    text = tok.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    before, after = text.split(marker, 1)
    return tok.encode(before, add_special_tokens=False), tok.encode(after, add_special_tokens=False)


@functools.lru_cache(maxsize=4)
def _sentence_ends(decoder: str, tiny_vocab: int | None) -> frozenset[int]:
    """Ids of the tokens whose text ends a sentence (``.``, ``!`` or ``?``, before closing quotes)."""
    tok = _tokenizer(decoder, tiny_vocab)
    if isinstance(tok, ByteCodec):
        return frozenset(ord(c) for c in ".!?")
    out = set()
    for i in range(len(tok)):
        text = tok.decode([i]).rstrip().rstrip("\"'\u201d\u2019)")
        if text.endswith((".", "!", "?")) and not text.endswith(".."):
            out.add(i)
    return frozenset(out)


def broken_answer(
    tok: Any, fact: str, ids: list[int], r: random.Random
) -> tuple[list[int], list[int]] | None:
    """``fact`` (spelled ``ids``) with one space between words, drawn at random, made a line break, as
    an answer breaks its line where the window's text is hard-wrapped; the tokenizer may spell the next
    word differently at a line's start (" to" and "to" are different tokens).

    Returns:
        ``(broken_ids, source)``: ``source[k]`` is the index in ``ids`` of the token that ``broken_ids[k]``
        copies (-1 for the line break itself), or None where the spellings do not line up token for token
        outside the break (or ``fact`` has no space after its first word).
    """
    spaces = [i for i, c in enumerate(fact) if c == " " and i > 0 and fact[i + 1 : i + 2].strip()]
    if not spaces:
        return None
    i = r.choice(spaces)
    head = tok.encode(fact[:i], add_special_tokens=False)
    nl = tok.encode("\n", add_special_tokens=False)
    rest = tok.encode(fact[i + 1 :], add_special_tokens=False)
    if not head or ids[: len(head)] != head or not rest:
        return None
    tail = 0  # the tokens both spellings end with
    while tail < min(len(rest), len(ids) - len(head)) and rest[-1 - tail] == ids[-1 - tail]:
        tail += 1
    odd_rest, odd_ids = len(rest) - tail, len(ids) - len(head) - tail  # the word at the break, respelled
    if odd_rest not in (0, odd_ids):  # no one-to-one copy for the respelled word
        return None
    source = list(range(len(head))) + [-1] * len(nl)
    source += [len(ids) - len(rest) + k for k in range(len(rest))]
    return head + nl + rest, source


def chat_prefix_length(decoder: str, tiny_vocab: int | None = None) -> int:
    """Tokens of the chat template's opening that start every ``qa`` decoder (0 without a template)."""
    return len(_chat_parts(decoder, tiny_vocab)[0])


def qa_example(
    enc: torch.Tensor,
    dec: torch.Tensor,
    r: random.Random,
    decoder: str,
    tiny_vocab: int | None = None,
    max_facts: int = 4,
    templates: int = NUM_TEMPLATES,
    inline: bool = False,
    span: float = 0.0,
    span_tokens: tuple[int, int] = SPAN_TOKENS,
    compound: float = 0.0,
    line_break: float = 0.0,
    decoys: float = 0.0,
    window_decoy: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plant facts in ``enc`` ``(K, L)`` and end ``dec`` ``(n,)`` with a question and its answer.

    Facts stand on lines of their own (``"\\n" + fact + "\\n"``), or with ``inline`` inside the text:
    ``" " + fact`` right after a token that ends a sentence (``.``, ``!``, ``?``), the fact's own tokens
    as the answer spells them; a text with no sentence end (code) gets its facts on their own lines.
    With ``span`` > 0 each fact is, with that probability, one whose value is a few tokens of the
    encoder's own text (:func:`make_span_fact`) instead of a word from the lists, ``span_tokens`` =
    ``(min, max)`` tokens long. With ``compound`` > 0 each fact is, with that probability, two facts in
    one sentence (:func:`compound_fact`; the second from the word lists), asked about its first clause.
    With ``line_break`` > 0 the answer breaks its line at a random space between words with that
    probability (:func:`broken_answer`): the break is not scored, the words after it are, their targets
    on the unbroken copy in the encoder. With ``decoys`` > 0, with that probability every fact but the
    asked one is a decoy (:func:`decoy_fact`): one to ``max_facts - 1`` facts that open with the asked
    fact's words, so that the answer's opening stands in the encoder more than once and the question
    alone says which copy to read on from. With ``window_decoy`` > 0, with that probability the decoder's own
    text before the question ends with a line that opens with the answer's first one or two words and goes
    on with words of the encoder's text (:func:`window_decoy_line`): the decoder's window then offers a
    continuation of the answer's opening, as a haystack sentence that opens as the needle does can stand
    last in the window, and the question alone says to read on from the encoder's copy.

    Returns:
        ``(encoder_ids (K, L), decoder_ids (n,), labels (n,), align (n,))``: the answer alone is scored;
        ``align[t]`` is the flat encoder position of the copy of token ``t + 1`` (-1 where there is none).

    Raises:
        ValueError: the decoder is too short for the chat template, question and answer.
    """
    tok = _tokenizer(decoder, tiny_vocab)
    stream = enc.reshape(-1).tolist()
    facts = []
    for _ in range(r.randint(1, max_facts)):
        drawn = span and r.random() < span  # no draw at 0: older runs unchanged
        value = span_value(stream, r, tok, span_tokens) if drawn else None
        fact = make_span_fact(r, value) if value else make_fact(r, templates)
        if compound and r.random() < compound:  # no draw at 0
            fact = compound_fact(fact, make_fact(r, templates))
        facts.append(fact)
    asked = r.randrange(len(facts))
    if decoys and r.random() < decoys:  # no draw at 0
        target = facts[asked]
        drawn = [
            decoy_fact(target, r, stream, tok, span_tokens)
            for _ in range(r.randint(1, max(1, max_facts - 1)))
        ]
        others = [f for f in drawn if f is not None]
        if others:  # the asked fact at a random place among its decoys
            asked = r.randint(0, len(others))
            facts = others[:asked] + [target] + others[asked:]
    m = len(stream)
    nl = tok.encode("\n", add_special_tokens=False)
    fact_ids = [tok.encode(f.fact, add_special_tokens=False) for f in facts]  # as the answer spells them
    # plant the facts at sorted random places, then cut the stream back to K·L tokens
    planted = sum(len(ids) + 2 * len(nl) for ids in fact_ids)
    ends = _sentence_ends(decoder, tiny_vocab) if inline else frozenset()
    room_m = max(1, m - planted)
    after_end = [i for i in range(1, room_m) if stream[i - 1] in ends] if inline else []
    if after_end:  # inside the text, after a sentence's end
        sep_before, sep_after = tok.encode(" ", add_special_tokens=False), []
        spots = sorted(r.choice(after_end) for _ in facts)
    else:
        sep_before, sep_after = nl, nl
        spots = sorted(r.randrange(0, room_m) for _ in facts)
    out, prev, where = [], 0, {}
    for i, (spot, ids) in enumerate(zip(spots, fact_ids)):
        out += stream[prev:spot] + sep_before
        where[i] = len(out)
        out += ids + sep_after
        prev = spot
    out += stream[prev:]
    out = out[:m]
    pos = where[asked]
    before, after = _chat_parts(decoder, tiny_vocab)
    question = tok.encode("\n\n" + facts[asked].question, add_special_tokens=False)
    answer = fact_ids[asked]  # the fact restated, token for token
    source = list(range(len(answer)))  # answer token -> the fact token it copies (-1: none)
    if line_break and r.random() < line_break:  # no draw at 0
        broken = broken_answer(tok, facts[asked].fact, answer, r)
        if broken is not None:
            answer, source = broken
    eos = getattr(tok, "eos_token_id", None)
    end = [int(eos)] if eos is not None else []  # then the end of the turn
    n = dec.shape[-1]
    room = n - len(before) - len(question) - len(after) - len(answer) - len(end)
    if room < 1:
        raise ValueError(
            f"qa examples need more than {n - room} decoder tokens (chat template, question, answer); "
            f"raise n_decoder (got {n})"
        )
    tail = dec[:room].tolist()
    if window_decoy and r.random() < window_decoy:  # no draw at 0
        line = window_decoy_line(facts[asked], r, stream, tok, span_tokens)
        decoy_ids = tok.encode(line, add_special_tokens=False) if line is not None else []
        if 0 < len(decoy_ids) < room:
            tail = tail[: room - len(decoy_ids)] + decoy_ids
    ids = before + tail + question + after + answer + end
    scored = [t if s >= 0 else -100 for t, s in zip(answer, source)]  # a line break is not scored
    labels = [-100] * (n - len(answer) - len(end)) + scored + end
    align = [-1] * n
    start = n - len(answer) - len(end)
    for j, s in enumerate(source):  # position start-1+j predicts answer token j, whose copy is at pos+s
        if s >= 0 and pos + s < m:
            align[start - 1 + j] = pos + s
    new_enc = torch.tensor(out, dtype=enc.dtype).reshape(enc.shape)
    return new_enc, torch.tensor(ids, dtype=dec.dtype), torch.tensor(labels), torch.tensor(align)
