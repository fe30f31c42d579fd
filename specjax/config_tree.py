"""Config helpers shared by every config tree: field checks whose errors name the field, dataclasses
built from nested dicts, and loading one tree from defaults <- a YAML file <- dotted CLI flags (tyro).

A dataclass whose tree lost a field to a new place lists it in a `MOVED_FIELDS` class attribute
({old dotted path: new dotted path}, relative to itself): a YAML key or CLI flag at the old path is
then refused with a message that names the new one, not as merely unknown. Every refusal is a
`UserError` (specjax.errors): the jobs print it as one line.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import os
import sys
import types
import typing
from typing import Any, Iterable, NoReturn, Sequence, TypeVar

from specjax.errors import UserError

T = TypeVar("T")

# set while tyro builds a config from flags (`apply_cli`)
_IN_CLI = contextvars.ContextVar("specjax_config_in_cli", default=False)


class _Refused(Exception):
  """A failed check while tyro builds the config. Not a ValueError: tyro would catch that and draw
  it in its own multi-line box; `apply_cli` raises the UserError it carries instead."""

  def __init__(self, error: UserError):
    super().__init__(str(error))
    self.error = error


def refuse(message: str) -> NoReturn:
  """Raise `UserError(message)`: a user's mistake, reported as one line by the jobs."""
  error = UserError(message)
  if _IN_CLI.get():
    raise _Refused(error)
  raise error


def check(cond: bool, where: str, msg: str) -> None:
  """Raise `UserError("<where>: <msg>")` (a ValueError) unless `cond`; `where` names the field
  (Config.field)."""
  if not cond:
    refuse(f"{where}: {msg}")


def one_of(value: Any, allowed: Iterable[Any], where: str) -> None:
  allowed = list(allowed)
  check(value in allowed, where, f"must be one of {allowed}, got {value!r}")


def _type_name(tp: Any) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _refuse(value: Any, expected: str, where: str) -> NoReturn:
  refuse(f"{where}: expected {expected}, got {value!r} ({type(value).__name__})")


def _convert(tp: Any, value: Any, where: str) -> Any:
  """`value` as a field of type `tp`, strictly: an int field refuses 2.5 and "three", a bool
  refuses "no" and 1, a str refuses 3; a float takes ints and numeric strings (YAML 1.1 reads
  `1e-3` as a string). Errors name the field (`where`)."""
  origin = typing.get_origin(tp)
  if dataclasses.is_dataclass(tp):
    return from_dict(tp, value, where)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
      if len(args) == len(typing.get_args(tp)):
        _refuse(value, " or ".join(map(_type_name, args)), where)
      return None
    return _convert(args[0], value, where) if len(args) == 1 else value
  if origin is typing.Literal:
    one_of(value, typing.get_args(tp), where)
    return value
  if tp is bool:
    if not isinstance(value, bool):
      _refuse(value, "a bool (true or false)", where)
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      _refuse(value, "an int", where)
    return value
  if tp is float:
    if isinstance(value, str):
      try:
        return float(value)
      except ValueError:
        _refuse(value, "a float", where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      _refuse(value, "a float", where)
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      _refuse(value, "a string", where)
    return value
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      _refuse(value, f"a list ({_type_name(tp)})", where)
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if args and len(args) != len(value):
      _refuse(value, f"a list of {len(args)} values ({_type_name(tp)})", where)
    return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value))) \
        if args else tuple(value)
  return value


def from_dict(cls: type[T], data: Any, where: str | None = None) -> T:
  """Build dataclass `cls` from a nested dict; unknown keys are errors that name the field."""
  where = where or cls.__name__
  if isinstance(data, cls):
    return data
  if not isinstance(data, dict):
    refuse(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - names)
  if unknown:
    refuse(f"{where}: unknown field(s) {unknown}; known: {sorted(names)}")
  kwargs = {k: _convert(hints[k], v, f"{where}.{k}") for k, v in data.items()}
  return cls(**kwargs)


def merge(base: dict, over: dict, where: str) -> dict:
  """`base` with the (nested) values of `over`; a key `base` lacks is an error naming it."""
  if not isinstance(over, dict):
    refuse(f"{where}: expected a mapping, got {type(over).__name__}")
  out = dict(base)
  for k, v in over.items():
    if k not in base:
      refuse(f"{where}.{k}: unknown field; known: {sorted(base)}")
    out[k] = merge(base[k], v, f"{where}.{k}") if isinstance(base[k], dict) and v is not None \
        else v
  return out


def moved_fields(cls: type, prefix: str = "") -> dict[str, str]:
  """{old dotted path: new dotted path} of every field moved in the tree of dataclass `cls` (each
  dataclass's `MOVED_FIELDS`, its paths prefixed by where that dataclass sits)."""
  moved = {prefix + old: prefix + new for old, new in getattr(cls, "MOVED_FIELDS", {}).items()}
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    if dataclasses.is_dataclass(hints[f.name]):
      moved.update(moved_fields(hints[f.name], f"{prefix}{f.name}."))
  return moved


def _refuse_moved_keys(cls: type, data: Any, where: str) -> None:
  """A UserError naming the new path of the first moved field that `data` (nested dicts) sets."""
  for old, new in moved_fields(cls).items():
    node = data
    for part in old.split("."):
      if not isinstance(node, dict) or part not in node:
        break
      node = node[part]
    else:
      refuse(f"{where}.{old}: moved to {new}")


def _refuse_moved_flags(cls: type, args: Sequence[str]) -> None:
  """A UserError naming the new flag of the first flag at a moved field's old path; tyro would
  refuse it too, but only as unrecognized. Flags are dotted, hyphenated paths; a bool's negation
  puts `no-` before its last part (`--rl.draft.no-online`)."""
  moved = moved_fields(cls)
  if not moved:
    return
  for arg in args:
    if not arg.startswith("--"):
      continue
    flag = arg[2:].split("=", 1)[0]
    *head, last = flag.replace("-", "_").split(".")
    negated = last.startswith("no_") and ".".join(head + [last]) not in moved
    path = ".".join(head + [last[3:] if negated else last])
    if path in moved:
      *new_head, new_last = moved[path].replace("_", "-").split(".")
      new = ".".join(new_head + [("no-" if negated else "") + new_last])
      refuse(f"--{flag}: moved to --{new}")


def apply_yaml(cfg: T, yaml_path: str, where: str | None = None) -> T:
  """`cfg` with the values of a YAML file nested like its dataclasses."""
  import yaml

  if not os.path.isfile(yaml_path):
    refuse(f"--config: {yaml_path} " + ("is not a file" if os.path.exists(yaml_path)
                                        else "does not exist"))
  with open(yaml_path) as f:
    try:
      data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:  # its message spans lines: keep the position only
      mark = getattr(e, "problem_mark", None)
      at = f":{mark.line + 1}" if mark is not None else ""
      problem = getattr(e, "problem", None) or type(e).__name__
      refuse(f"{yaml_path}{at}: not valid YAML ({problem})")
  cls = type(cfg)
  where = where or f"{yaml_path}: {cls.__name__}"
  _refuse_moved_keys(cls, data, where)
  try:
    return from_dict(cls, merge(dataclasses.asdict(cfg), data, where), where)
  except ValueError as e:  # a range check in __post_init__ names the field, not the file
    if str(e).startswith(f"{yaml_path}:"):
      raise
    refuse(f"{yaml_path}: {e}")


def apply_cli(cfg: T, args: Sequence[str], **tyro_kw: Any) -> T:
  """`cfg` with dotted CLI flags (tyro: `--grpo.group-size 8`) applied."""
  import tyro

  _refuse_moved_flags(type(cfg), args)
  token = _IN_CLI.set(True)
  try:
    return tyro.cli(type(cfg), default=cfg, args=list(args), **tyro_kw)
  except _Refused as e:  # with the traceback down to the failed check (--debug shows it)
    raise e.error.with_traceback(e.__traceback__) from None
  finally:
    _IN_CLI.reset(token)


def load(cls: type[T], yaml_path: str | None = None, cli_args: Sequence[str] | None = (),
         base: T | None = None) -> T:
  """Defaults (`base`, else `cls()`) <- YAML file <- CLI flags (`cli_args=None` reads sys.argv)."""
  cfg = base if base is not None else cls()
  if yaml_path:
    cfg = apply_yaml(cfg, yaml_path)
  args = sys.argv[1:] if cli_args is None else list(cli_args)
  return apply_cli(cfg, args) if args else cfg


def split_config_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
  """(the value of `--config FILE` / `--config=FILE`, the other arguments)."""
  parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  parser.add_argument("--config", default=None)
  known, rest = parser.parse_known_args(list(argv))
  return known.config, rest


def parse_args(defaults: T, argv: Sequence[str] | None = None, **tyro_kw: Any) -> T:
  """A launcher's config: defaults <- `--config file.yaml` <- the other (dotted) CLI flags; tyro
  also answers `--help`."""
  yaml_path, rest = split_config_flag(sys.argv[1:] if argv is None else argv)
  cfg = defaults
  if yaml_path:
    cfg = apply_yaml(cfg, yaml_path, f"{yaml_path}: {type(cfg).__name__}")
  return apply_cli(cfg, rest, **tyro_kw)
