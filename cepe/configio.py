"""One way to load a configuration: a YAML/JSON file, ``key.sub=value`` overrides, a validated dataclass.

Every workflow's configuration is a dataclass (``TrainConfig``, ``BenchConfig``, ``StoreBenchConfig``, each
evaluation task's ``Config``); :func:`load_config` reads a file, applies overrides and builds the dataclass
with :func:`build`, which rejects unknown keys, missing required keys and values of the wrong type with a
message that names the key and the file. Override values are parsed as YAML (``--set totals=[1024,2048]``,
``optim.lr=1e-4``, ``progress=false``). Stdlib only (``yaml`` on first use), so the command line can use it
without importing torch.

Type rules (the field annotations are read as strings, ``from __future__ import annotations``):
``bool`` fields take only ``true``/``false``; ``int`` and ``float`` fields take numbers, numeric strings
(YAML reads ``1e-3`` as text) or ``true``/``false`` (1 / 0) and become that number type (an ``int`` field rejects ``1.5``); ``str`` fields
take strings; ``list[...]`` / ``tuple[...]`` fields take lists, each item by these same rules (``key[i]`` in
errors; an item already of its type is kept as it is), ``dict[...]`` fields mappings; a section (a field whose
default is a dataclass) a mapping, built the same way (anything else is refused); ``Literal[...]``
fields one of the listed values, and so do fields with ``field(metadata={"choices": ...})`` (each item of a
list); ``X | None`` also ``null``. Anything else is passed through unchecked.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


def read_config_file(path: str | os.PathLike[str], allow_empty: bool = False) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or JSON config file into a mapping (an empty file: ``{}`` when
    ``allow_empty``).

    A file may start from others: ``extends: base.yaml`` (or a list of files, applied in order), each path
    relative to the file that names it. The bases are read the same way (they may extend too) and merged
    with :func:`merge_configs`, the file's own keys last, so a recipe states only what it changes.

    Raises:
        FileNotFoundError: the file, or a base it extends, does not exist.
        ValueError: the file is not a mapping, ``extends`` is not a path or a list of paths, or the
            chain of ``extends`` comes back to a file already in it.
    """
    return _read_config_file(Path(path), allow_empty, ())


def _read_config_file(p: Path, allow_empty: bool, chain: tuple[Path, ...]) -> dict[str, Any]:
    if not p.is_file():
        raise FileNotFoundError(
            f"config file {p} not found" + (f" (extended by {chain[-1]})" if chain else "")
        )
    text = p.read_text(encoding="utf-8")
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{p} is not valid YAML: {err}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{p} is not valid JSON: {err}") from None
    if data is None and (allow_empty or chain):
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a config must be a mapping of keys to values")
    if "extends" not in data:
        return data
    bases = data.pop("extends")
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not bases or not all(isinstance(b, str) and b for b in bases):
        raise ValueError(f"{p}: extends must be a config file path or a list of them, got {bases!r}")
    here = p.resolve()
    if here in chain:
        loop = " -> ".join(str(c) for c in (*chain, here))
        raise ValueError(f"{p}: extends comes back to a file already in the chain ({loop}); remove one link")
    merged: dict[str, Any] = {}
    for base in bases:
        merged = merge_configs(merged, _read_config_file(p.parent / base, True, (*chain, here)))
    return merge_configs(merged, data)


def merge_configs(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top`` over it: sections (mappings) merge key by key, any other value of ``top``
    (a list, a number, ``null``) replaces the base's. Neither argument is changed."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_configs(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_value(text: str) -> Any:
    """An override's value, parsed as YAML (``1e-4`` is read as a string and converted by :func:`build`)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(
            f"cannot read {text!r} as a value ({problem}); quote a string, close a list"
        ) from None


def set_dotted(data: dict[str, Any], key: str | tuple[str, ...], value: Any) -> None:
    """``set_dotted(d, "a.b", 1)`` sets ``d["a"]["b"] = 1`` (creating mappings on the way); a tuple key is
    the path itself, so ``("a", "b.c")`` sets ``d["a"]["b.c"]`` (a mapping's key that holds a dot)."""
    parts = key.strip().split(".") if isinstance(key, str) else [str(p) for p in key]
    key = ".".join(parts)
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


def apply_overrides(
    data: dict[str, Any],
    overrides: Iterable[str | tuple[str | tuple[str, ...], Any]],
    where: str = "override",
) -> dict[str, Any]:
    """A copy of ``data`` with ``key.sub=value`` strings (values parsed as YAML) or ``(key, value)`` pairs
    (already typed, e.g. from a generated flag: :func:`flag_overrides`; ``key`` dotted or a tuple path, as
    for :func:`set_dotted`) applied in order."""
    out = copy.deepcopy(data)
    for item in overrides:
        if isinstance(item, tuple):
            set_dotted(out, *item)
            continue
        if "=" not in item:
            raise ValueError(f"{where}: override {item!r} must look like key=value or section.key=value")
        key, value = item.split("=", 1)
        set_dotted(out, key, parse_value(value))
    return out


def build(cls: type[C], data: Any, where: str = "config") -> C:
    """Build dataclass ``cls`` from a mapping, checking keys and value types (see the module docstring).

    Raises:
        ValueError: naming ``where`` and the offending key.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; known keys are {sorted(fields)}")
    missing = [
        f.name
        for f in fields.values()
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ValueError(f"{where} is missing required keys {missing}")
    data = {
        k: _value(fields[k], v, f"{where}.{k}") for k, v in data.items() if not _null_default(fields[k], v)
    }
    try:
        return cls(**data)
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from err


def load_config(
    cls: type[C],
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str | tuple[str, Any]] = (),
    data: dict[str, Any] | None = None,
    where: str = "config",
) -> C:
    """Load dataclass ``cls`` from ``path`` (YAML/JSON) or ``data``, with ``key=value`` ``overrides``.

    Errors name the file (when there is one) and the key: ``configs/x.yaml: unknown config keys ['lr']``.
    """
    raw = read_config_file(path) if path is not None else dict(data or {})
    try:
        return build(cls, apply_overrides(raw, overrides), where)
    except ValueError as err:
        raise ValueError(f"{path}: {err}" if path is not None else str(err)) from err


def _value(f: dataclasses.Field, value: Any, key: str) -> Any:
    nested = _nested_dataclass(f)
    if nested is not None:
        if isinstance(value, dict):
            return build(nested, value, key)  # a section: ``optim: {lr: ...}``
        if not isinstance(value, nested):  # (null was dropped before: the section's defaults)
            raise ValueError(
                f"{key} is a section: give it a mapping of its keys ({f.name}: {{KEY: VALUE}} in a file, "
                f"--set {f.name}.KEY=VALUE), got {value!r}"
            )
        return value
    value = _coerce(str(f.type), value, key)
    choices = f.metadata.get("choices")
    if choices and value is not None:  # the generated flag's choices, for a file and --set too
        if isinstance(value, (list, tuple)):
            bad = [item for item in value if item not in choices]
            if bad:
                raise ValueError(f"{key}: unknown {f.name} {bad}; choose from {list(choices)}")
        elif value not in choices:
            raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")
    return value


def _element_kinds(base: str, n: int) -> list[str] | None:
    """The element types of a ``list[X]`` / ``tuple[X, ...]`` / ``tuple[X, Y]`` annotation for ``n`` items
    (None: not a typed sequence, or a tuple of another length, left to the dataclass)."""
    for head in ("list[", "tuple["):
        if base.startswith(head) and base.endswith("]"):
            inner = [p.strip() for p in _split_top(base[len(head) : -1])]
            if head == "list[" and len(inner) == 1:
                return inner * n
            if len(inner) == 2 and inner[1] == "...":
                return inner[:1] * n
            return inner if len(inner) == n and "..." not in inner else None
    return None


def _split_top(text: str) -> list[str]:
    """``"int, dict[str, int]"`` → ``["int", " dict[str, int]"]``: split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _coerce_items(kind: str, value: list | tuple, key: str) -> list | tuple:
    """Each item of a typed list by the scalar rules (``key[i]`` in errors). An item already of its type is
    kept as it is (an int in a ``list[float]`` stays an int, so a config's fingerprint does not change);
    a numeric string or an integral float is converted; anything else is refused."""
    kinds = _element_kinds(kind, len(value))
    if kinds is None:
        return value
    out = []
    for i, (item_kind, item) in enumerate(zip(kinds, value, strict=True)):
        ok = {
            "int": isinstance(item, int),
            "float": isinstance(item, (int, float)),
            "str": isinstance(item, str),
            "bool": isinstance(item, bool),
        }.get(item_kind)
        if ok is False:
            item = _coerce(item_kind, item, f"{key}[{i}]")
        elif ok is None and item_kind.startswith("Literal["):
            _coerce(item_kind, item, f"{key}[{i}]")  # one of the listed values
        out.append(item)
    return type(value)(out)


def _split_optional(kind: str) -> tuple[str, bool]:
    parts = [p.strip() for p in kind.split("|")]
    optional = "None" in parts
    rest = [p for p in parts if p != "None"]
    if len(rest) == 1:
        return rest[0], optional
    return kind, optional  # a union of several types: unchecked


def _null_default(f: Any, value: Any) -> bool:
    """Null for a field that cannot be None but has a default: the default (the key is dropped)."""
    if value is not None or _split_optional(str(f.type))[1]:
        return False
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING  # type: ignore[misc]


def _coerce(kind: str, value: Any, key: str) -> Any:
    base, optional = _split_optional(kind)
    if value is None:
        plain = base in ("bool", "int", "float", "str", "list", "tuple", "dict") or base.startswith(
            ("list[", "tuple[", "dict[")
        )
        if plain and not optional:  # would fail only where it is used, after the model loads
            raise ValueError(f"{key} cannot be null: it takes a {base}")
        return value  # other kinds: the dataclass's own validation decides
    if base == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if base in ("int", "float"):
        try:  # true / false count as 1 / 0 (e.g. ``data.shuffle: true`` = every window)
            number = float(value) if base == "float" else int(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{key} must be a number ({base}), got {value!r}") from None
        if base == "int" and isinstance(value, float) and value != number:
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return number
    if base == "str" and not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    if base.startswith(("list[", "tuple[")) or base in ("list", "tuple"):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return _coerce_items(base, value, key)
    if (base.startswith("dict[") or base == "dict") and not isinstance(value, dict):
        raise ValueError(f"{key} must be a mapping, got {value!r}")
    if base.startswith("Literal[") and base.endswith("]"):
        try:
            choices = ast.literal_eval(f"({base[len('Literal[') : -1]},)")
        except (ValueError, SyntaxError):
            return value
        if value not in choices:
            raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- flags
# Command-line flags generated from a config dataclass. Hand-written over argparse (not jsonargparse or
# tyro): the parser must build from the dataclasses' string annotations without importing torch (``cepe
# --help`` stays light), it must keep the flag spellings the docs already use (``--max-tokens full=N``,
# ``--no-progress``), and values must go through :func:`build`'s typing rule so that a flag, a ``--set``
# and a config file give the same dataclass (and the same training fingerprint).

FLAG_PREFIX = "cfg:"  # argparse ``dest`` of a generated flag: ``cfg:`` + the dotted key


def field_docs(cls: type) -> dict[str, str]:
    """Per-field help from a Google-style docstring: ``name: text`` (also ``a / b: text``, ``a, b: text``
    and ````name````), continuation lines indented deeper, under any section (``Attributes:``, ...)."""
    import inspect
    import re

    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    current: list[str] = []
    indent = 0
    name = r"(?:``)?[a-z_][a-z0-9_]*(?:``)?"
    entry = re.compile(rf"^(\s*)({name}(?:\s*[/,]\s*{name})*):\s*(.*)$")
    for line in doc.splitlines():
        m = entry.match(line)
        keys = [k.strip("` ") for k in re.split(r"[/,]", m.group(2))] if m else []
        if m and keys and all(k in names for k in keys):
            current, indent = keys, len(m.group(1))
            for k in keys:
                out[k] = m.group(3).strip()
        elif current and line.strip() and len(line) - len(line.lstrip()) > indent:
            for k in current:
                out[k] = f"{out[k]} {line.strip()}".strip()
        else:
            current = []
    # several entries on one line: "steps: optimizer steps. batch_size: examples per step."
    inline = re.compile(rf"(?:^|(?<=\.)\s+)({name}(?:\s*[/,]\s*{name})*):\s")
    for key, text in list(out.items()):
        pieces = inline.split(text)  # [head, names, text, names, text, ...]
        for names_, part in zip(pieces[1::2], pieces[2::2]):
            keys = [k.strip("` ") for k in re.split(r"[/,]", names_)]
            if all(k in names for k in keys):
                for k in keys:
                    out[k] = part.strip()
                out[key] = out[key].replace(f"{names_}: {part}", "").strip()
    return out


def _flag_type(kind: str) -> tuple[str, str | None]:
    """(``"bool" | "int" | "float" | "str" | "list" | "dict" | "yaml"``, the element type of a list)."""
    base, _ = _split_optional(kind)
    if base in ("bool", "int", "float", "str"):
        return base, None
    for outer in ("list[", "tuple["):
        if base.startswith(outer) and base.endswith("]"):
            inner = base[len(outer) : -1].split(",")[0].strip()
            return "list", inner if inner in ("int", "float", "str") else None
    if base.startswith("dict[") or base == "dict":
        return "dict", None
    return "yaml", None


def _yaml_value(text: str) -> Any:
    return parse_value(text)


def _key_value(text: str) -> tuple[str, Any]:
    import argparse

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), parse_value(value)


def add_config_flags(
    parser: Any,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    aliases: dict[str, list[str]] | None = None,
    prefix: str = "",
    config_file: str | None = None,
    _in_file: bool = False,
) -> None:
    """Add one flag per field of dataclass ``cls`` to an ``argparse`` parser.

    ``field_name`` becomes ``--field-name`` (nested dataclass fields ``--section.field-name``); its type,
    choices (a ``Literal`` annotation or ``field(metadata={"choices": ...})``) and help (the docstring, see
    :func:`field_docs`, plus the default) come from the dataclass. ``bool`` fields get ``--x`` / ``--no-x``,
    lists take several values, ``dict`` fields take ``KEY=VALUE`` (repeatable; merged into the mapping),
    anything else a YAML value. A flag not given leaves the file's value alone (read them back with
    :func:`flag_overrides`). ``config_file``: also add ``--config FILE`` (this help) and ``--set KEY=VALUE``;
    without it, a field with no default is a required flag.
    """
    import argparse

    if config_file is not None:
        parser.add_argument("--config", help=config_file)
        parser.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help="override a config key, the value read as YAML (repeatable; after the file, before the "
            "other flags): --set key.sub=value",
        )
    docs = field_docs(cls)
    skip = set(exclude)
    aliases = aliases or {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip:
            continue
        key = f"{prefix}{f.name}"
        nested = _nested_dataclass(f)
        if nested is not None:
            in_file = _in_file or config_file is not None
            add_config_flags(parser, nested, prefix=f"{key}.", exclude=[], aliases=aliases, _in_file=in_file)
            continue
        flag = "--" + key.replace("_", "-")
        names = [flag, *aliases.get(key, [])]
        kind, inner = _flag_type(str(f.type))
        choices = f.metadata.get("choices") or _literal_choices(str(f.type))
        help_text = docs.get(f.name, "")
        default = _default(f)
        if default is not dataclasses.MISSING and "default:" not in help_text:  # the doc may say it
            help_text = f"{help_text} (default: {default})".strip()
        kw: dict[str, Any] = {"dest": FLAG_PREFIX + key, "default": argparse.SUPPRESS}
        if default is dataclasses.MISSING and config_file is None and not _in_file:
            kw["required"] = True  # nothing else can give it
        kw["help"] = _plain(help_text).replace("%", "%%") or None
        if kind != "bool":
            kw["metavar"] = key.rsplit(".", 1)[-1].upper()
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "dict":
            kw.update(action="append", type=_key_value, metavar="KEY=VALUE")
            kw["help"] = f"{kw['help'] or ''} (repeatable KEY=VALUE: sets {key}.KEY)".strip()
        elif kind == "list":
            conv = {"int": int, "float": float, "str": str}.get(inner or "", _yaml_value)
            kw.update(nargs="+", type=conv)
            if choices:
                kw.update(choices=list(choices), metavar="{" + ",".join(map(str, choices)) + "}")
        elif kind in ("int", "float", "str"):
            kw["type"] = {"int": int, "float": float, "str": str}[kind]
            if choices:
                kw.update(choices=list(choices), metavar=None)
        else:
            kw["type"] = _yaml_value
            kw["help"] = f"{kw['help'] or ''} (a YAML value)".strip()
        parser.add_argument(*names, **kw)


def add_const_flag(parser: Any, name: str, key: str, value: Any, help: str | None = None) -> None:
    """A flag without a value that sets config ``key`` to ``value``, read back by :func:`flag_overrides` like
    a generated flag: spellings kept from hand-written parsers (``--quiet`` = ``--no-progress``)."""
    import argparse

    parser.add_argument(
        name, dest=FLAG_PREFIX + key, action="store_const", const=value, default=argparse.SUPPRESS, help=help
    )


def flag_overrides(args: Any) -> list[tuple[str | tuple[str, ...], Any]]:
    """The generated flags given on the command line, as ``(dotted key, value)`` overrides for
    :func:`apply_overrides` (a ``dict`` flag's ``KEY=VALUE`` items become overrides of the path
    ``(*field, KEY)``, so that a KEY with a dot in it, ``mix_head.bias``, stays one key of the mapping)."""
    out: list[tuple[Any, Any]] = []
    for dest, value in vars(args).items():
        if not dest.startswith(FLAG_PREFIX):
            continue
        key = dest[len(FLAG_PREFIX) :]
        if isinstance(value, list) and value and all(isinstance(v, tuple) for v in value):
            out.extend(((*key.split("."), k), v) for k, v in value)
        else:
            out.append((key, value))
    return out


def config_from_args(cls: type[C], args: Any, where: str = "config", base: dict | None = None) -> C:
    """Dataclass ``cls`` from ``--config FILE`` (or ``base``), then ``--set`` overrides, then the generated
    flags given (the last wins); errors name the file and the key."""
    path = getattr(args, "config", None)
    overrides: list[Any] = [*(getattr(args, "set", None) or []), *flag_overrides(args)]
    return load_config(cls, path, overrides, data=base, where=where)


def _plain(text: str) -> str:
    """Docstring markup to terminal text: ````x```` → ``x``, ``:mod:`x``` → ``x``."""
    import re

    return re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text).replace("``", "")


def _nested_dataclass(f: dataclasses.Field) -> type | None:
    """The dataclass of a section field (``data: DataConfig = field(default_factory=DataConfig)``)."""
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return type(value)
    return None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _literal_choices(kind: str) -> tuple[Any, ...] | None:
    base, _ = _split_optional(kind)
    if base.startswith("Literal[") and base.endswith("]"):
        try:
            return ast.literal_eval(f"({base[len('Literal[') : -1]},)")
        except (ValueError, SyntaxError):
            return None
    return None
