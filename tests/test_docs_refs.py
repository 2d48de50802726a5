"""The docs name only what exists: every repository path, Python name, ``cepe`` sub-command and flag that
``README.md`` and ``docs/*.md`` write in code (inline code, fenced blocks and the comments in them) or
link to. Every failure is reported at once, with the document and its line.

- **Paths** starting ``configs/``, ``scripts/``, ``results/``, ``adapters/``, ``cepe/``, ``tests/``,
  ``docs/`` or ``.ci/`` are tracked files, directories of tracked files (``git ls-files``), or the stem of
  tracked files (``--out results/x`` writes ``results/x.json`` and ``results/x.md``); ``x.{json,md}`` is
  each of ``x.json`` and ``x.md``. Patterns and placeholders are not checked: ``<...>``, ``*``, ``$VAR``,
  ``...``, and a path with a component (or a part of one between ``_``, ``-``, ``.``) that is one of the
  capitalised words of :data:`PLACEHOLDERS` or a single capital after lower-case letters (``stepN``,
  ``shift_bB``). ``runs/`` holds local outputs and is not checked. ``file.py::name`` names a function,
  class or module-level assignment of that file (``Class::method`` a method), read with ``ast``;
  ``path:LINE`` checks the path. A markdown link's target is read relative to its document.
- **``cepe`` commands**: ``cepe SUB [SUBSUB] ...`` names a sub-command of the parser the executable builds
  (:func:`cepe.cli.build_parser`, which imports no torch: the flags are generated from the typed configs),
  each ``--flag`` (up to any ``=``) is one of that sub-command's option strings spelled in full, and a
  word right after a sub-command that takes a positional with choices (``cepe eval TASK``) is one of them
  (each of ``a|b``).
- **``python scripts/X.py`` commands**: a script builds its parser inside ``main()``, most after importing
  torch, so no parser is taken by running them. A script's flags are read from its source with ``ast``
  instead: the option strings of every ``add_argument`` call in the script and in the repository
  functions it calls that add arguments (``cepe.bench.kernels.shape_parser``), and its ``add_parser``
  sub-command names; a flag of any of its parsers is accepted. A script that hands what it does not parse
  to ``cepe.cli.main`` (``parse_known_args``) is checked up to its first ``cepe`` sub-command, and the rest
  as a ``cepe`` command. A script whose flags cannot be read so (no ``ArgumentParser``, an option string
  that is not a literal, ``parse_known_args`` for another use) is only checked to exist.

A word is a command where a shell would run it: first in a command (after ``VAR=value`` words, ``nice``,
``time``, ``env``, ``do``, ``then``, ...), or after ``&&``, ``||``, ``;``, ``|``, ``(``, a lone ``=`` or a word
ending in ``:`` (``# server: cepe serve ...``). In a fenced block a new line starts a new command unless
the line ends in ``\\``; in inline code a line break is a soft wrap. Python, YAML and JSON blocks are read
for their comments' commands only (``from cepe import ...`` is no command).

Two short lists name what the docs may name although it is not in the tree, each entry checked too:
:data:`HISTORICAL` (removed since; it must exist at the commit given, not now, and the doc must give that
commit next to it) and :data:`PENDING` (an output a tracked script writes when it runs, not committed
yet; it must not exist, and the script must still say that it writes it). An entry no doc needs fails too.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# capitalised words the docs write for a value the reader supplies (``runs/recipe/NAME``, ``OUT.json``)
PLACEHOLDERS = frozenset(
    "NAME DIR OUT ADAPTER ADAPTERS STAGE CONFIG TASK LOG FILE VARIANT ARM KEEP STEP ID PATH".split()
)
# words before a command's program: wrappers (their ``-x`` options skipped) and shell keywords
WRAPPERS = frozenset(
    {"nice", "time", "env", "nohup", "exec", "command", "do", "then", "else", "if", "while", "!"}
)
BOUNDARIES = frozenset({"&&", "||", ";", "|", "(", "$(", "="})

# reference -> (the commit where it exists, why the doc names it): removed since, named by a dated record
HISTORICAL = {
    "configs/train/recipe/mix_warmup_stats60.yaml": (
        "40bd884",
        "removed with its option in f2020a8; the record says the run is reproduced at that commit",
    ),
    "tests/test_chain_scripts.py::test_heads_and_validate_drops_a_jemalloc_preload_and_keeps_others": (
        "5c72b4e",
        "replaced in b22abe4 by test_heads_and_validate_runs_under_jemalloc_where_there_is_one when the "
        "evaluations came to purge jemalloc; the record names what was tested that day",
    ),
}
# path -> (the tracked script that writes it, the words of that script that say so, why not committed yet)
PENDING = {
    "results/recipe/mix_fit19h/fit150_int8": (
        "scripts/heads_and_validate.sh",
        "res=results/recipe/$name/fit150_int8",
        "the chain's heads recipe after read_lm9h: its validation results land when the chain gets there",
    ),
    "results/recipe/soup_qa2_gates_break_rebuilt/step040": (
        "scripts/rebuild_choice.sh",
        "into results/recipe/soup_qa2_gates_break_rebuilt/",
        "the rebuilt average's probes, written when the rebuild is run",
    ),
    "results/recipe/fast_soup_linux_s2_rebuilt/step040": (
        "scripts/rebuild_choice.sh",
        "into results/recipe/fast_soup_linux_s2_rebuilt/",
        "the rebuilt choice's probes, written when the rebuild is run",
    ),
    "results/recipe/mix_choice/step060": (
        "scripts/rebuild_choice.sh",
        "probes into results/recipe/mix_choice/step060/",
        "the head over the rebuilt choice, probed when the rebuild is run",
    ),
}


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


# --------------------------------------------------------------------------------------------- markdown


@dataclass
class Snippet:
    """Code of a document: an inline code span, a fenced block, a comment in a block, or a link target."""

    doc: str
    line: int  # the line of text[0]
    text: str
    kind: str  # "inline" | "fence" | "comment" | "link"
    lang: str = ""

    def line_of(self, offset: int) -> int:
        return self.line + self.text.count("\n", 0, offset)


FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def snippets(path: Path) -> list[Snippet]:
    """The code of one markdown file: fenced blocks (and their ``#`` comments), inline code spans (which
    may wrap over the lines of a paragraph) and link targets outside code."""
    doc = path.relative_to(ROOT).as_posix()
    out: list[Snippet] = []
    fence: tuple[str, str, int] | None = None  # (marker, language, first line inside)
    body: list[str] = []
    para: list[tuple[int, str]] = []
    for no, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0][0] and len(m.group(1)) >= len(fence[0]) and not m.group(2):
                out.extend(_fenced(doc, fence[2], "\n".join(body), fence[1]))
                fence, body = None, []
            else:
                body.append(line)
        elif m:
            out.extend(_inline(doc, para))
            fence, body, para = (m.group(1), m.group(2).lower(), no + 1), [], []
        elif not line.strip():
            out.extend(_inline(doc, para))
            para = []
        else:
            para.append((no, line))
    out.extend(_inline(doc, para))
    assert fence is None, f"{doc}:{fence[2] - 1}: a fenced block is never closed"
    return out


def _inline(doc: str, para: list[tuple[int, str]]) -> list[Snippet]:
    """The inline code spans of a paragraph (a run of N backticks up to the next run of exactly N) and its
    link targets outside them."""
    if not para:
        return []
    first = para[0][0]
    text = "\n".join(line for _, line in para)
    out: list[Snippet] = []
    outside: list[tuple[int, str]] = []
    pos = 0
    for m in re.finditer(r"`+", text):
        if m.start() < pos:
            continue
        close = re.compile(rf"(?<!`){m.group()}(?!`)").search(text, m.end())
        if close is None:
            continue  # a lone backtick is text
        outside.append((pos, text[pos : m.start()]))
        out.append(
            Snippet(doc, first + text.count("\n", 0, m.end()), text[m.end() : close.start()], "inline")
        )
        pos = close.end()
    outside.append((pos, text[pos:]))
    for start, part in outside:
        for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", part):
            out.append(Snippet(doc, first + text.count("\n", 0, start + m.start()), m.group(1), "link"))
    return out


def _fenced(doc: str, line: int, text: str, lang: str) -> list[Snippet]:
    """A fenced block, and each ``#`` comment in it as a snippet of its own (read like inline code)."""
    out = [Snippet(doc, line, text, "fence", lang)]
    for no, row in enumerate(text.split("\n")):
        m = re.search(r"(?:^|\s)#\s?(.*)$", row)
        if m:
            out.append(Snippet(doc, line + no, m.group(1), "comment", lang))
    return out


# ------------------------------------------------------------------------------------------------ paths


@cache
def tracked() -> tuple[frozenset[str], frozenset[str]]:
    """(tracked files, directories that hold tracked files), relative to the repository root."""
    try:
        out = _git("ls-files", "-z")
    except OSError:
        pytest.skip("no git: the tracked files are unknown")
    if out.returncode:
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = frozenset(f for f in out.stdout.split("\0") if f)
    dirs = {p.as_posix() for f in files for p in Path(f).parents if p != Path(".")}
    return files, frozenset(dirs)


@cache
def _stems() -> frozenset[str]:
    """Tracked files without their last suffix (``results/x`` for ``results/x.json``)."""
    return frozenset(f.rsplit(".", 1)[0] for f in tracked()[0] if "." in f.rsplit("/", 1)[-1])


PATH = re.compile(
    r"(?<![\w./$~-])(?:\.ci|configs|scripts|results|adapters|cepe|tests|docs)/"
    r"(?:\{[^\s`'\"{}]*\}|[^\s`'\",{}])*"  # a comma ends a path, except inside {a,b}
)
TRAILING = ".,;:)`"


def expand_braces(token: str) -> list[str]:
    """``x.{json,md}`` → ``x.json``, ``x.md``, as the shell expands it."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    if m is None:
        return [token]
    return [
        t for alt in m.group(1).split(",") for t in expand_braces(token[: m.start()] + alt + token[m.end() :])
    ]


def is_placeholder(token: str) -> bool:
    if any(s in token for s in ("<", ">", "*", "{", "}", "…", "...", "$", "?", "[", "]", "|")):
        return True
    return any(w in PLACEHOLDERS or re.fullmatch(r"[a-z]*[A-Z]", w) for w in re.split(r"[/._:-]", token))


def defined_names(source: str) -> frozenset[str]:
    """Top-level functions, classes and assignments of Python source, and ``Class::method`` names."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)


@cache
def _names_in(path: str) -> frozenset[str]:
    return defined_names((ROOT / path).read_text(encoding="utf-8"))


def split_reference(token: str) -> tuple[str, str] | None:
    """``(path, name)`` of a path token (``name`` from ``path::name``, or ""); None for a placeholder."""
    path, _, name = token.partition("::")
    if is_placeholder(path):
        return None
    path = re.sub(r":\d+(?:-\d+)?$", "", path.rstrip(TRAILING)).rstrip(TRAILING)  # path:LINE
    return path, re.sub(r"\[.*$", "", name.rstrip(TRAILING))  # a parametrised test id: its function


def check_path(path: str, name: str) -> str | None:
    """What is wrong with a reference (None: it exists)."""
    files, dirs = tracked()
    bare = path.rstrip("/")
    if bare not in files and bare not in dirs and bare not in _stems():
        return f"no such file or directory {path!r}"
    if name and bare.endswith(".py") and name not in _names_in(bare):
        return f"{bare} defines no {name!r}"
    return None


def path_failures(s: Snippet, used: set[str]) -> list[str]:
    """The broken paths of a snippet; the exceptions it uses go into ``used``."""
    if s.kind == "link":
        target = s.text.split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):
            return []  # an anchor or a URL
        parts: list[str] = []
        for part in [*Path(s.doc).parent.parts, *target.split("/")]:
            if part == "..":
                parts = parts[:-1]
            elif part not in ("", "."):
                parts.append(part)
        problem = check_path("/".join(parts), "")
        return [f"{s.doc}:{s.line}: link to {target!r}: {problem}"] if problem else []
    out = []
    for m in PATH.finditer(s.text):
        token = m.group()
        if token.endswith("::"):  # ``file.py::`` and the name wrapped onto the next line
            after = re.match(r"\s*([A-Za-z_]\w*(?:::\w+)?)", s.text[m.end() :])
            token += after.group(1) if after else ""
        for one in expand_braces(token):
            ref = split_reference(one)
            if ref is None:
                continue
            key = "::".join(p for p in ref if p)
            if key in HISTORICAL or ref[0].rstrip("/") in PENDING:
                used.add(key if key in HISTORICAL else ref[0].rstrip("/"))
                continue
            problem = check_path(*ref)
            if problem:
                out.append(f"{s.doc}:{s.line_of(m.start())}: {problem}")
    return out


# --------------------------------------------------------------------------------------------- commands

WORD = re.compile(r"(?:[^\s'\"\\]|\\.|'[^']*'|\"(?:[^\"\\]|\\.)*\")+", re.S)


@dataclass
class Word:
    text: str  # quotes removed
    line: int


def commands(s: Snippet) -> list[list[Word]]:
    """The shell commands of a snippet, each a list of words."""
    text = s.text.replace("\\\n", " \n")  # a continued line (same length: the offsets keep their lines)
    continued = {m.start() + 1 for m in re.finditer(r"\\\n", s.text)}
    if s.kind == "fence":  # comments blanked: they are snippets of their own
        text = re.sub(r"(^|\s)#[^\n]*", lambda m: m.group(1) + " " * (len(m.group()) - len(m.group(1))), text)
    out: list[list[Word]] = [[]]
    end = 0
    for m in WORD.finditer(text):
        gap = text[end : m.start()]
        if s.kind == "fence" and any(c == "\n" and end + i not in continued for i, c in enumerate(gap)):
            out.append([])
        end = m.end()
        raw = m.group()
        if raw in BOUNDARIES or raw.endswith((":", ";")):
            out.append([])
            continue
        try:
            words = shlex.split(raw)
        except ValueError:
            words = []
        word = words[0] if len(words) == 1 else raw
        out[-1].append(Word(word.removeprefix("("), s.line_of(m.start())))
    return [c for c in out if c]


def _program(words: list[Word]) -> list[Word]:
    """A command's words from its program on: ``VAR=value`` words and ``nice -n 19`` dropped."""
    i = 0
    while i < len(words):
        if re.fullmatch(r"[A-Za-z_]\w*=\S*", words[i].text):
            i += 1
        elif words[i].text in WRAPPERS:
            i += 1
            while i < len(words) and words[i].text.startswith("-"):
                i += 2 if words[i].text == "-n" else 1
        else:
            break
    return words[i:]


@cache
def cepe_parser() -> argparse.ArgumentParser:
    from cepe.cli import build_parser

    return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flag(word: str) -> str | None:
    """The option string a word gives (``[--stage`` → ``--stage``, ``--set=a`` → ``--set``), or None."""
    w = word.strip("[]()")
    return w.split("=", 1)[0].rstrip(",;") if re.match(r"--?[A-Za-z]", w) else None


def _choices(word: str) -> list[str]:
    """``lm|ralm|qa`` → its names; none where the word is a placeholder or not a name."""
    w = word.strip("[](),")
    if _flag(w) or not re.fullmatch(r"[a-z0-9_-]+(?:\|[a-z0-9_-]+)*", w):
        return []
    return w.split("|")


def check_cepe(words: list[Word], doc: str) -> list[str]:
    """Failures of ``cepe`` with these words after it."""
    parser, name, rest = cepe_parser(), "cepe", list(words)
    while rest and (subs := _subcommands(parser)):
        first = rest[0].text
        if not re.fullmatch(r"[a-z][a-z0-9-]*", first):
            break  # a flag of this level, or a placeholder (``<command>``, ``...``)
        if first not in subs:
            return [f"{doc}:{rest[0].line}: `{name}` has no sub-command {first!r}"]
        parser, name, rest = subs[first], f"{name} {first}", rest[1:]
    out = []
    positional = [
        a
        for a in parser._actions
        if not a.option_strings and a.choices and not isinstance(a, argparse._SubParsersAction)
    ]
    if rest and positional:
        for choice in _choices(rest[0].text):
            if choice not in positional[0].choices:
                out.append(f"{doc}:{rest[0].line}: `{name}` takes no {positional[0].dest} {choice!r}")
    for w in rest:
        if w.text == "--":
            break
        flag = _flag(w.text)
        if flag and flag not in parser._option_string_actions:
            out.append(f"{doc}:{w.line}: `{name}` has no flag {flag}")
    return out


def _imported(tree: ast.Module) -> dict[str, tuple[str, Path | None]]:
    """Names imported ``from module import name``: (module, its source file in the repository or None)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = ROOT / Path(*node.module.split("."))
            candidates = (
                base.with_suffix(".py"),
                base / "__init__.py",
                ROOT / "scripts" / f"{node.module}.py",
            )
            source = next((c for c in candidates if c.is_file()), None)
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, source)
    return out


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    """Calls of ``name(...)`` or ``x.name(...)`` under ``tree``."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and name in (getattr(n.func, "attr", None), getattr(n.func, "id", None))
    ]


def _added(tree: ast.AST) -> tuple[set[str], set[str], bool]:
    """(option strings, sub-command names, whether every option string is a literal) of the
    ``add_argument`` / ``add_parser`` calls under ``tree``."""
    flags: set[str] = set()
    literal = True
    for call in _calls(tree, "add_argument"):
        strings = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        literal = literal and bool(call.args) and len(strings) == len(call.args)
        flags.update(s for s in strings if s.startswith("-"))
    subs = {
        c.args[0].value
        for c in _calls(tree, "add_parser")
        if c.args and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str)
    }
    return flags, subs, literal


@dataclass(frozen=True)
class ScriptInterface:
    flags: frozenset[str]
    subcommands: frozenset[str]
    forwards_to_cepe: bool  # what it does not parse goes to ``cepe.cli.main``


@cache
def script_interface(rel: str) -> ScriptInterface | None:
    """What a script's parser accepts, read from its source; None where that cannot be read."""
    tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
    flags, subs, literal = _added(tree)
    has_parser = bool(_calls(tree, "ArgumentParser"))
    imported = _imported(tree)
    for name, (_, source) in imported.items():
        if source is None or not _calls(tree, name):
            continue
        for fn in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(fn, ast.FunctionDef) and fn.name == name:
                more, more_subs, more_literal = _added(fn)
                if more or more_subs:  # a repository function that adds arguments
                    has_parser = has_parser or bool(_calls(fn, "ArgumentParser"))
                    flags, subs, literal = flags | more, subs | more_subs, literal and more_literal
    forwards = any(
        isinstance(n, ast.ImportFrom) and n.module == "cepe.cli" and any(a.name == "main" for a in n.names)
        for n in ast.walk(tree)
    )
    if _calls(tree, "parse_known_args") and not forwards:
        return None  # takes flags it does not declare
    if not has_parser or not literal:
        return None
    return ScriptInterface(frozenset(flags), frozenset(subs), forwards)


def check_script(rel: str, words: list[Word], doc: str) -> list[str]:
    """Failures of ``python scripts/X.py`` with these words after it."""
    if rel not in tracked()[0]:
        return []  # reported as a path
    interface = script_interface(rel)
    if interface is None:
        return []
    out = []
    if interface.forwards_to_cepe:
        at = next((i for i, w in enumerate(words) if w.text in _subcommands(cepe_parser())), len(words))
        out.extend(check_cepe(words[at:], doc))
        words = words[:at]
    if interface.subcommands and words and not _flag(words[0].text):
        for choice in _choices(words[0].text):
            if choice not in interface.subcommands:
                out.append(f"{doc}:{words[0].line}: {rel} has no sub-command {choice!r}")
    for w in words:
        if w.text == "--":
            break
        flag = _flag(w.text)
        if flag and flag not in interface.flags and flag not in ("-h", "--help"):
            out.append(f"{doc}:{w.line}: {rel} has no flag {flag}")
    return out


def command_failures(s: Snippet) -> list[str]:
    if s.kind == "link" or (s.kind == "fence" and s.lang in ("python", "py", "yaml", "json", "toml")):
        return []
    out = []
    for words in commands(s):
        words = _program(words)
        if not words:
            continue
        program = words[0].text
        if program == "cepe":
            out.extend(check_cepe(words[1:], s.doc))
        elif program in ("python", "python3") and len(words) > 1 and words[1].text.startswith("scripts/"):
            out.extend(check_script(words[1].text, words[2:], s.doc))
        elif program.startswith("scripts/") and program.endswith(".py"):
            out.extend(check_script(program, words[1:], s.doc))
    return out


# ------------------------------------------------------------------------------------------- exceptions


def exception_failures(used: set[str], texts: dict[str, list[str]]) -> list[str]:
    """The named exceptions hold: each is still needed and named by a doc, a historical one exists at its
    commit (and the doc gives the commit within two lines), a pending one's script still writes it."""
    out = []
    files, dirs = tracked()
    for ref, (commit, _) in HISTORICAL.items():
        path, _, name = ref.partition("::")
        if ref not in used:
            out.append(f"HISTORICAL {ref!r}: no doc names it any more; remove the entry")
            continue
        if check_path(path, name) is None:
            out.append(f"HISTORICAL {ref!r}: it exists now; remove the entry")
        # a shallow clone lacks old commits: the reference's past is then not checked, the rest is
        if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0:
            then = _git("show", f"{commit}:{path}")
            if then.returncode or (name and name not in defined_names(then.stdout)):
                out.append(f"HISTORICAL {ref!r}: not at commit {commit}")
        for doc, lines in texts.items():
            for i, line in enumerate(lines):
                if ref in line and not any(commit in x for x in lines[max(0, i - 2) : i + 3]):
                    out.append(f"{doc}:{i + 1}: {ref!r} is removed: give commit {commit} next to it")
    for path, (script, says, _) in PENDING.items():
        if path not in used:
            out.append(f"PENDING {path!r}: no doc names it any more; remove the entry")
        if path in files or path in dirs:
            out.append(f"PENDING {path!r}: it is committed now; remove the entry")
        if script not in files or says not in (ROOT / script).read_text(encoding="utf-8"):
            out.append(f"PENDING {path!r}: {script} is not tracked or no longer says {says!r}")
    return out


# ------------------------------------------------------------------------------------------------ tests


def failures(paths: list[Path] | None = None) -> list[str]:
    """Every broken reference of the docs (or of ``paths``), as ``doc:line: what``."""
    out: list[str] = []
    used: set[str] = set()
    for path in paths or _docs():
        for s in snippets(path):
            if s.kind != "comment":  # a comment's paths are read with its block
                out.extend(path_failures(s, used))
            out.extend(command_failures(s))
    if paths is None:
        texts = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8").split("\n") for p in _docs()}
        out.extend(exception_failures(used, texts))
    return out


def test_docs_name_only_what_exists():
    """Every path, Python name, ``cepe`` sub-command and flag the docs name exists (all failures at once)."""
    found = failures()
    assert not found, f"{len(found)} broken references in the docs:\n" + "\n".join(found)


def test_design_counts_the_recipe_configs_that_extend_another():
    """docs/DESIGN.md says how many recipe configs extend another: the count follows the tree."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    said = re.search(r"(\d+) of (\d+) `extends:` another", text)
    assert said, "docs/DESIGN.md no longer says how many recipe configs extend another"
    configs = sorted((ROOT / "configs" / "train" / "recipe").glob("*.yaml"))
    extending = [p for p in configs if re.search(r"^extends:", p.read_text(), re.MULTILINE)]
    assert (int(said[1]), int(said[2])) == (len(extending), len(configs)), (
        f"docs/DESIGN.md says {said[0]!r}; the tree has {len(extending)} of {len(configs)}"
    )
