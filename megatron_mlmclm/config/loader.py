"""A typed YAML loader: a YAML file plus dotted `key.sub=value` overrides -> a tree of dataclasses,
with strict keys and types. Knows nothing of what it loads: the run config and the evaluation's
task registry both use it.

Types understood: bool, int, float, str, `Literal[...]` (a fixed set of choices), `X | None`,
`float | SomeDataclass` (a mapping is the dataclass), `list[X]`, `dict[str, X]`, nested dataclasses.
A dataclass may rename YAML keys with a class attribute `YAML_KEYS = {"from": "start"}`. Every
problem raises UsageError naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from yaml.constructor import ConstructorError
from yaml.parser import ParserError
from yaml.scanner import ScannerError

from megatron_mlmclm.errors import UsageError


def load(cls, path: str | os.PathLike | None, overrides: Sequence[str] = ()):
    """YAML file (or None for the defaults) + `a.b=value` overrides -> a `cls` tree."""
    return from_dict(cls, read_raw(path, overrides), prefix="")


def read_raw(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """YAML file (or None for the defaults) + `a.b=value` overrides -> the raw mapping."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    for item in overrides:
        apply_override(raw, item)
    return raw


# Values a YAML document may expand to through its aliases: far past any config or task file
# (the largest shipped file holds about 1,000), far below what nested aliases reach in a few
# hundred bytes (9 aliases a level, 8 levels: 43 million).
MAX_EXPANDED = 1_000_000


class UserYaml(yaml.SafeLoader):
    """YAML as a user's file or flag holds it, read safely (no Python objects) and strictly: no
    key given twice in one mapping (the second would silently win), and aliases (`*name`) only as
    far as the document they expand to stays under MAX_EXPANDED values (a few hundred bytes of
    nested aliases expand to gigabytes when the result is copied or written out), never to
    itself."""

    def construct_document(self, node):
        size = _expanded(node, {})
        if size > MAX_EXPANDED:
            raise ConstructorError(
                None,
                None,
                f"its aliases (*name) expand it to {size:,} values, past {MAX_EXPANDED:,}: "
                "write the values out",
                node.start_mark,
            )
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    again = key in seen
                    seen.add(key)
                except TypeError:  # unhashable: the mapping itself refuses it
                    continue
                if again:
                    raise ConstructorError(
                        None, None, f"key {key!r} is given twice", key_node.start_mark
                    )
        return super().construct_mapping(node, deep)


def _expanded(node, sizes: dict[int, int | None]) -> int:
    """How many values `node` stands for with every alias written out (an alias is the node it
    names: counted once per use). Refuses a node that holds itself."""
    key = id(node)
    if key in sizes:
        known = sizes[key]
        if known is None:  # still being counted: the node holds itself
            raise ConstructorError(
                None, None, "an alias (*name) refers to the value holding it", node.start_mark
            )
        return known
    sizes[key] = None
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded(k, sizes) + _expanded(v, sizes) for k, v in node.value)
    else:
        size = 1
    sizes[key] = size
    return size


def parse_yaml(text: str, source: str, text_if_not_yaml: bool = False) -> Any:
    """`text` read by UserYaml; any problem (syntax, an alias, a key given twice, nesting past
    what a parser can follow) is a UsageError naming `source` and the line. With
    `text_if_not_yaml`, text that does not parse as YAML is the text itself (an override's
    value: a path with a colon, a word)."""
    try:
        return yaml.load(text, Loader=UserYaml)  # noqa: S506 (UserYaml is a SafeLoader)
    except (ScannerError, ParserError) as e:
        if text_if_not_yaml:
            return text
        raise _yaml_problem(e, source) from None
    except yaml.YAMLError as e:
        raise _yaml_problem(e, source) from None
    except RecursionError:
        raise UsageError(f"{source} is nested too deeply to read") from None


def _yaml_problem(e: yaml.YAMLError, source: str) -> UsageError:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark is not None else ""
    return UsageError(f"{source}{where} is not valid YAML: {getattr(e, 'problem', None) or e}")


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file {p} does not exist; pass the path of a YAML config")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"config file {p} is not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise UsageError(f"cannot read config file {p}: {e.strerror}") from None
    raw = parse_yaml(text, f"config file {p}")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError(
            f"config file {p} must hold a mapping of sections, not {type(raw).__name__}"
        )
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`train.steps=50`, `phases.1.mask_ratio=0.3`, `data.train=[a,b]` (values parsed as YAML)."""
    if "=" not in item:
        raise UsageError(f"override {item!r} must look like key.sub=value")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise UsageError(f"override {item!r} has an empty key part; use e.g. train.steps=50")
    value = parse_yaml(text, f"override {key}", text_if_not_yaml=True) if text != "" else None
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            node = node[_list_index(node, part, key)]
        else:
            if part not in node or node[part] is None:
                # Phases default to one entry; an override on phases.N needs that list to exist.
                node[part] = [] if nxt.isdigit() else {}
            node = node[part]
        if not isinstance(node, (dict, list)):  # set to a value by the file or an override
            raise UsageError(
                f"override {key}: {'.'.join(parts[: i + 1])} is {node!r}, not a section, so it "
                f"has no {nxt!r}"
            )
    last = parts[-1]
    if isinstance(node, list):
        idx = int(last) if last.isdigit() else None
        if idx is None or idx > len(node):
            raise UsageError(f"override {key}: index {last} out of range (list has {len(node)})")
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, key: str) -> int:
    if not part.isdigit():
        raise UsageError(f"override {key}: {part!r} must be a list index")
    idx = int(part)
    if idx == len(node):
        node.append({})
    if idx >= len(node):
        raise UsageError(f"override {key}: index {idx} out of range (list has {len(node)})")
    return idx


# A schema's annotations are strings (`from __future__ import annotations`): evaluated once per
# class, not at every entry read (4 ms each: a task registry reads dozens).
_type_hints = functools.cache(typing.get_type_hints)


def from_dict(cls, raw: Any, prefix: str):
    """Build dataclass `cls` from `raw` with strict key and type checks."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UsageError(f"{prefix or 'config'} must be a mapping, got {type(raw).__name__}")
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names, key=str)  # YAML keys may be numbers or null
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise UsageError(f"unknown config key '{key}'; valid keys here: {', '.join(sorted(names))}")
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [f"{prefix}{name}" for name in required if name not in raw]
    if missing:
        raise UsageError(f"missing config key(s) {', '.join(missing)}")
    kwargs = {}
    for name in names:
        if name in raw:
            kwargs[name] = _convert(hints[name], raw[name], f"{prefix}{name}")
    return cls(**kwargs)


def _convert(tp, value, key: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and typing.get_origin(inner[0]) is Literal:
            return _choice(typing.get_args(inner[0]), value, key, optional=type(None) in args)
        if isinstance(value, dict):  # float | SomeDataclass: a mapping is the dataclass
            inner = [a for a in inner if dataclasses.is_dataclass(a)] or inner
        return _convert(inner[0], value, key)
    if origin is Literal:
        return _choice(args, value, key, optional=False)
    if dataclasses.is_dataclass(tp):
        renames = getattr(tp, "YAML_KEYS", {})
        if renames and isinstance(value, dict):
            value = {renames.get(k, k): v for k, v in value.items()}
        return from_dict(tp, value, f"{key}.")
    if origin is list:
        (item_tp,) = args
        if not isinstance(value, list):
            if item_tp is str and isinstance(value, str):
                return [value]
            raise UsageError(f"config key '{key}' must be a list, got {value!r}")
        return [_convert(item_tp, v, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, item_tp = args
        if not isinstance(value, dict):
            raise UsageError(f"config key '{key}' must be a mapping, got {value!r}")
        return {
            _convert(key_tp, k, f"{key}.{k}"): _convert(item_tp, v, f"{key}.{k}")
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UsageError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 5e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None or math.isnan(number):
            raise UsageError(f"config key '{key}' must be a number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off / on (no / yes) as a boolean
            return "on" if value else "off"
        if isinstance(value, (str, int, float)):
            return str(value)
        raise UsageError(f"config key '{key}' must be a string, got {value!r}")
    return value


def _choice(choices: tuple, value, key: str, optional: bool):
    """A `Literal` field: the value (read as a string where the choices are strings: YAML reads a
    bare off as false) must be one of the choices."""
    if all(isinstance(c, str) for c in choices) and isinstance(value, (bool, int, float)):
        value = _convert(str, value, key)
    if value not in choices:
        raise UsageError(
            f"{key} '{value}' must be one of {', '.join(map(str, choices))}"
            + (" (or null)" if optional else "")
        )
    return value


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
