"""The flags of fxpar.Config, generated from its fields: `fxpar check`, `fxpar show`, `fxpar plan` (and `fxpar
schedule`, for the three fields it draws) call add_config_flags, so a new field is a flag of each at once, with the
help text written beside the field in fxpar/config.py. tests/test_cli_flags.py freezes the list.

    Config.virtual_stages  ->  --virtual-stages V   (also --vpp V: ALIASES)
    Config.fuse            ->  --fuse / --no-fuse
    Config.overlap         ->  --overlap early_collectives,late_waits   (none: the default passes)

A value is parsed as its field's type (parse_field, which the fuzzer's --config KEY=VALUE uses too): a bool as
true/false (on/off), None as `none`, a tuple comma-separated, MixedPrecision by its dtype (bf16, fp16). Only the flags
given reach the command (config_overrides), so each command keeps its own defaults for the rest: `fxpar check` draws
2 p v microbatches with a pipeline, `fxpar plan` searches what it is not told. A command leaves out the fields it sets
itself (`owned`): check's --seed and --precision set seed and mixed_precision.
"""
from __future__ import annotations

import argparse
import types
import typing
from dataclasses import fields

import torch

from fxpar.config import Config
from fxpar.mixed_precision import MixedPrecision

ALIASES = {"virtual_stages": ("--vpp",)}  # the paper's v, as Megatron spells it
PREFIX = "config."  # where the given values land on the parsed namespace
_TRUE, _FALSE = ("true", "on", "yes"), ("false", "off", "no")
_LOW = {"bf16": MixedPrecision(torch.bfloat16), "bfloat16": MixedPrecision(torch.bfloat16),
        "fp16": MixedPrecision(torch.float16, loss_scale="dynamic"),
        "float16": MixedPrecision(torch.float16, loss_scale="dynamic")}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kinds(name: str) -> tuple:
    hint = typing.get_type_hints(Config)[name]
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def parse_field(name: str, text: str):
    """`text` as a value of Config's field `name`; ValueError saying what the field takes."""
    known = {f.name for f in fields(Config)}
    if name not in known:
        raise ValueError(f"{name!r} is not a field of fxpar.Config; the fields are {sorted(known)}")
    kinds, value = _kinds(name), text.strip()
    order = [type(None), bool, int, float, tuple, MixedPrecision, str]  # str last: it takes anything
    for kind in sorted(kinds, key=lambda k: order.index(typing.get_origin(k) or k)):
        if kind is type(None) and value.lower() == "none":
            return None
        if kind is bool and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        if typing.get_origin(kind) is tuple:
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if kind is MixedPrecision and value.lower() in _LOW:
            return _LOW[value.lower()]
        if kind in (int, float, str):
            try:
                return kind(value)
            except ValueError:
                continue
    takes = " or ".join(_describe(k) for k in kinds)
    raise ValueError(f"{flag(name)} {text!r}: Config.{name} takes {takes}")


def _describe(kind) -> str:
    if kind is type(None):
        return "none"
    if kind is bool:
        return "true/false"
    if kind is MixedPrecision:
        return "a dtype (bf16, fp16)"
    if typing.get_origin(kind) is tuple:
        return "a comma-separated list"
    return f"a{'n' if kind is int else ''} {kind.__name__}"


def add_config_flags(parser: argparse.ArgumentParser, *, owned=(), only=None, auto=(), defaults=None) -> None:
    """One flag per field of Config, in a group of their own. owned: fields the command sets itself (no flag); only:
    just these fields; auto: fields `fxpar plan` searches, whose flags also take `auto` (bools too take a value);
    defaults: {field: text} where the command's default is not Config's (for the help). A value is only set when
    given, so the command's defaults stay its own."""
    defaults = defaults or {}
    group = parser.add_argument_group("fxpar.Config", "the options of the parallel model (fxpar/config.py); "
                                                      "unset ones keep this command's default")
    for f in fields(Config):
        if f.name in owned or (only is not None and f.name not in only):
            continue
        names, kinds = (flag(f.name), *ALIASES.get(f.name, ())), _kinds(f.name)
        help = f"{f.metadata['help']} (default {_shown(defaults.get(f.name, f.default))})".replace("%", "%%")
        if bool in kinds and set(kinds) <= {bool, type(None)} and f.name not in auto:  # none: unset
            group.add_argument(*names, dest=PREFIX + f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help)
            continue
        metavar = {(int,): "N", (float,): "X", (bool,): "BOOL"}.get(kinds, "VALUE")
        group.add_argument(*names, dest=PREFIX + f.name, default=argparse.SUPPRESS, help=help,
                           metavar=metavar + ("|auto" if f.name in auto else ""), type=_parser(f.name, f.name in auto))


def _shown(value) -> str:
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    return str(value)


def _parser(name: str, auto: bool):
    def parse(text: str):
        if auto and text.strip().lower() == "auto":
            return "auto"
        try:
            return parse_field(name, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = f"Config.{name}"  # argparse names the type in its error
    return parse


def config_overrides(args: argparse.Namespace) -> dict:
    """{field: value} of the Config flags given on the command line."""
    return {key[len(PREFIX):]: value for key, value in vars(args).items() if key.startswith(PREFIX)}
