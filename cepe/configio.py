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
take strings; ``list[...]`` / ``tuple[...]`` fields take lists, ``dict[...]`` fields mappings; ``Literal[...]``
fields one of the listed values; ``X | None`` also ``null``. Anything else is passed through unchecked.
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
    ``allow_empty``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} not found")
    text = p.read_text(encoding="utf-8")
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a config must be a mapping of keys to values")
    return data


def parse_value(text: str) -> Any:
    """An override's value, parsed as YAML (``1e-4`` is read as a string and converted by :func:`build`)."""
    import yaml

    return yaml.safe_load(text)


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``set_dotted(d, "a.b", 1)`` sets ``d["a"]["b"] = 1`` (creating mappings on the way)."""
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


def apply_overrides(
    data: dict[str, Any], overrides: Iterable[str], where: str = "override"
) -> dict[str, Any]:
    """A copy of ``data`` with ``key.sub=value`` strings applied (values parsed as YAML)."""
    out = copy.deepcopy(data)
    for item in overrides:
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
    data = {k: _coerce(str(fields[k].type), v, f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**data)
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from err


def load_config(
    cls: type[C],
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
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


def _split_optional(kind: str) -> tuple[str, bool]:
    parts = [p.strip() for p in kind.split("|")]
    optional = "None" in parts
    rest = [p for p in parts if p != "None"]
    if len(rest) == 1:
        return rest[0], optional
    return kind, optional  # a union of several types: unchecked


def _coerce(kind: str, value: Any, key: str) -> Any:
    base, optional = _split_optional(kind)
    if value is None:
        return value  # None for a non-optional field: the dataclass's own validation decides
    if base == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if base in ("int", "float"):
        try:  # true / false count as 1 / 0 (e.g. ``data.shuffle: true`` = every window)
            number = float(value) if base == "float" else int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number ({base}), got {value!r}") from None
        if base == "int" and isinstance(value, float) and value != number:
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return number
    if base == "str" and not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    if (base.startswith(("list[", "tuple[")) or base in ("list", "tuple")) and not isinstance(
        value, (list, tuple)
    ):
        raise ValueError(f"{key} must be a list, got {value!r}")
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
