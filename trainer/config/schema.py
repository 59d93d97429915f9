"""Typed dataclass trees from nested dicts and YAML files: the generic half of the run configuration.

Nothing here knows memlm's sections. Give `build` a dataclass type and a mapping and get back an instance whose
every value has its annotated type, or one ConfigError that names the full dotted key. Supported annotations:
int, float (ints accepted), bool, str, list[X], dict[str, Any] (a free mapping, e.g. a Hugging Face model's config
given inline: its keys are the other library's, checked there), Optional[X] / X | None and nested dataclasses; a field
may also be
limited to a fixed set of strings through the `choices` table (dotted key -> allowed values).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from memlm.models.config import ConfigError

Choices = Mapping[str, Collection[str]]
FindParent = Callable[[str, Path], Path]  # (an inherit: value, the naming file's folder) -> the parent's file


# ---------------------------------------------------------------------------------------------------------------
# dict -> dataclass


def build(cls: type, data: Any, *, prefix: str = "", choices: Choices | None = None) -> Any:
    """An instance of dataclass `cls` from mapping `data`; absent keys keep their defaults."""
    if data is None:  # an empty YAML section (`model:` with everything commented out)
        data = {}
    if not isinstance(data, Mapping):
        where = f"'{prefix}'" if prefix else "the top level"
        raise ConfigError(f"{where} must be a mapping of keys, got {_show(data)}")
    hints = field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            raise unknown_key_error(str(key), list(hints), prefix)
        kwargs[key] = convert(hints[key], value, join(prefix, key), choices or {})
    return cls(**kwargs)


def convert(tp: Any, value: Any, dotted: str, choices: Choices, *, declared: Any = None) -> Any:
    """`value` checked against annotation `tp` (and the choices for `dotted`); raises ConfigError naming it.

    `declared` is the annotation to name in a type error (Optional[int] when `tp` is its int).
    """
    declared = declared or tp
    if tp is Any:  # a value inside a free mapping (dict[str, Any]): checked by whatever reads the mapping
        return copy.deepcopy(value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, prefix=dotted, choices=choices)
    inner = optional_inner(tp)
    if inner is not None:
        return None if value is None else convert(inner, value, dotted, choices, declared=tp)
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise _type_error(dotted, declared, value)
        (item_tp,) = typing.get_args(tp)
        return [convert(item_tp, v, f"{dotted}[{i}]", choices) for i, v in enumerate(value)]
    if typing.get_origin(tp) is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _type_error(dotted, declared, value)
        return copy.deepcopy(dict(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(dotted, declared, value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):  # bool is an int subclass: refuse `true` for 3
            raise _type_error(dotted, declared, value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(dotted, declared, value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _type_error(dotted, declared, value)
        allowed = choices.get(dotted)
        if allowed is not None and value not in allowed:
            close = difflib.get_close_matches(value, allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{dotted}: {value!r} is not one of {' | '.join(allowed)}{hint}")
        return value
    raise TypeError(f"config schema: unsupported annotation {tp!r} for {dotted}")  # a schema bug, not user input


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of the dataclass fields a constructor accepts, in declaration order."""
    hints = typing.get_type_hints(cls)  # resolves string annotations (`from __future__ import annotations`)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def optional_inner(tp: Any) -> Any:
    """X for Optional[X] / X | None, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp: Any) -> str:
    inner = optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} or null"
    if typing.get_origin(tp) is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return "a mapping of keys"
    return {bool: "bool (true/false)", int: "int", float: "float", str: "str"}.get(tp, repr(tp))


def _type_error(dotted: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{dotted}: expected {type_name(tp)}, got {_show(value)}")


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def unknown_key_error(key: str, valid: list[str], prefix: str = "") -> ConfigError:
    """One message: the dotted key, the closest valid name and every valid name of that section."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{join(prefix, close[0])}'?)" if close else ""
    section = f"'{prefix}'" if prefix else "the top level"
    return ConfigError(f"unknown key '{join(prefix, key)}'{hint}; valid keys in {section}: {', '.join(valid)}")


def join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def key_type(cls: type, dotted: str) -> Any:
    """The annotation of dotted key `dotted` below dataclass `cls`; ConfigError if no such key exists."""
    tp: Any = cls
    prefix = ""
    for part in dotted.split("."):
        if tp is Any or typing.get_origin(tp) is dict:  # a key inside a free mapping: any YAML value
            tp, prefix = Any, join(prefix, part)
            continue
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"'{prefix}' is a single value, not a section: there is no key '{dotted}'")
        hints = field_types(tp)
        if part not in hints:
            raise unknown_key_error(part, list(hints), prefix)
        tp, prefix = hints[part], join(prefix, part)
    return tp


# ---------------------------------------------------------------------------------------------------------------
# dataclass -> dict


def to_dict(obj: Any) -> Any:
    """Nested plain dicts and lists (copies) from a dataclass tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return copy.deepcopy(obj)


def flatten_dict(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values, and so does an empty mapping (model.backbone_config: {}),
    which would otherwise leave no key at all."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten_dict(value, join(prefix, key)))
        else:
            flat[join(prefix, key)] = value
    return flat


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """tree["a"]["b"] = value for "a.b", creating (or replacing non-mapping) sections on the way."""
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, anything else (lists included) replaces."""
    merged = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        elif value is None and isinstance(merged.get(key), Mapping):
            continue  # an empty section in the child (`model:`) keeps the parent's section
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# ---------------------------------------------------------------------------------------------------------------
# YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats: PyYAML (YAML 1.1) reads `lr: 1e-4` as the string '1e-4'."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml_value(text: str, what: str) -> Any:
    """A YAML scalar or flow list/mapping ("16", "[1, 2]", "false", "1e-4"); ConfigError naming `what`."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: cannot read {text!r} as a YAML value ({_one_line(exc)})") from exc


def read_yaml(path: Path) -> Any:
    """The parsed document at `path`; a missing file or a syntax error is a one-line ConfigError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a folder, not a YAML file: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML syntax error {_one_line(exc)}") from exc


def _one_line(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(exc).split())


def load_tree(path: str | Path, *, inherit_key: str = "inherit", find_parent: FindParent | None = None,
              _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping in a YAML file with its `inherit:` parents merged underneath.

    `inherit` may name one file or a list; later parents and then the file itself win. A parent is a path relative
    to the file, or whatever `find_parent(value, the file's folder)` makes of it (the run config's: a preset name
    too); it raises a ConfigError for a parent it cannot find.
    """
    path = Path(path)
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {_show(data)}")
    parents = data.pop(inherit_key, None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: '{inherit_key}' must be a file name or a list of file names, got {_show(parents)}")
    chain = _chain + (path.resolve(),)
    merged: dict[str, Any] = {}
    for parent in parents:
        try:
            parent_path = (find_parent or file_beside)(parent, path.parent).resolve()
        except ConfigError as exc:
            raise ConfigError(f"{path}: '{inherit_key}: {parent}': {exc}") from None
        if parent_path in chain:
            raise ConfigError(f"{path}: '{inherit_key}: {parent}' makes a cycle ({' -> '.join(p.name for p in chain)})")
        merged = deep_merge(merged, load_tree(parent_path, inherit_key=inherit_key, find_parent=find_parent,
                                              _chain=chain))
    return deep_merge(merged, data)


def file_beside(name: str, folder: Path) -> Path:
    """`inherit:`'s plain meaning: the file `name`, relative to the folder of the file that names it."""
    path = folder / name
    if not path.is_file():
        raise ConfigError(f"inherited file not found: {path.resolve()}")
    return path


class _Dumper(yaml.SafeDumper):
    """Sections as blocks, lists inline (`cutoffs: [20000, 40000]`): reads like the hand-written presets."""


_Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data,
                                                                            flow_style=True))


def to_yaml(tree: Mapping[str, Any]) -> str:
    """YAML in the tree's own key order."""
    return yaml.dump(dict(tree), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
