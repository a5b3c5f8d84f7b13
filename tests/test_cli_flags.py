"""The Config flags of `fxpar check`, `fxpar show` and `fxpar plan` come from fxpar.Config's fields
(fxpar/cli/config_flags.py): the flag lists are frozen here, and a field added to Config fails this test until the list
below names its flag."""
from __future__ import annotations

import dataclasses
import json

import pytest

from fxpar.cli.config_flags import flag, parse_field
from fxpar.cli.main import build_parser, main
from fxpar.config import Config
from fxpar.mixed_precision import MixedPrecision

CONFIG_FLAGS = ["--microbatches", "--virtual-stages", "--vpp", "--schedule", "--scatter-gather", "--fuse", "--no-fuse",
                "--sequence-parallel", "--no-sequence-parallel", "--recompute", "--compile", "--no-compile",
                "--joint-graph", "--no-joint-graph", "--overlap", "--trace-dir", "--dump-dir", "--bucket-mb", "--seed",
                "--check-replicas-every", "--zero", "--ep-dispatch", "--mixed-precision"]
FLAGS = {
    "check": ["--tp", "--pp", "--dp", "--ep", "--precision", "--steps", "--lr", "--seed",
              *[f for f in CONFIG_FLAGS if f not in ("--seed", "--mixed-precision")]],  # the check's own seed, precision
    "show": ["--tp", "--rank", "--format", "--pp", "--chunk", "--ep", *CONFIG_FLAGS],
    "plan": ["--layers", "--hidden", "--heads", "--seq", "--vocab", "--ffn", "--experts", "--top-k", "--expert-ffn",
             "--batch", "--gpus", "--cluster", "--tp", "--pp", "--microbatch", "--ep", "--max-tp", "--no-paper-rule", "--precision",
             # m follows from b, the schedule from v, the precision is --precision's; --sequence-parallel takes a value
             *[f for f in CONFIG_FLAGS if f not in ("--microbatches", "--schedule", "--mixed-precision",
                                                    "--no-sequence-parallel")],
             "--tokens", "--top", "--json"],
}


def _flags(command: str) -> list[str]:
    parser = next(a for a in build_parser()._actions if a.choices and command in a.choices).choices[command]
    return [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")]


@pytest.mark.parametrize("command", sorted(FLAGS))
def test_the_flag_list_is_frozen(command):
    assert _flags(command) == FLAGS[command]


def test_every_config_field_is_a_flag():
    assert [flag(f.name) for f in dataclasses.fields(Config)] == [f for f in CONFIG_FLAGS if not f.startswith("--no-")
                                                                   and f != "--vpp"]


def test_a_field_added_to_config_is_a_flag_of_every_command(monkeypatch):
    """A new field reaches check, show and plan without touching them (and this file's list is what then fails)."""
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Grown(Config):
        new_knob: int = dataclasses.field(default=3, metadata={"help": "a field added later"})

    monkeypatch.setattr("fxpar.cli.config_flags.Config", Grown)
    for command in FLAGS:
        assert "--new-knob" in _flags(command), command


@pytest.mark.parametrize("name, text, value", [
    ("microbatches", "4", 4), ("bucket_mb", "0.5", 0.5), ("fuse", "false", False), ("sequence_parallel", "on", True),
    ("seed", "none", None), ("seed", "7", 7), ("scatter_gather", "auto", "auto"), ("scatter_gather", "true", True),
    ("overlap", "early_collectives,dp_buckets", ("early_collectives", "dp_buckets")), ("overlap", "", ()),
    ("trace_dir", "/tmp/t", "/tmp/t"), ("mixed_precision", "bf16", MixedPrecision()),
])
def test_a_value_is_parsed_as_its_fields_type(name, text, value):
    assert parse_field(name, text) == value


@pytest.mark.parametrize("name, text, says", [("microbatches", "two", "takes an int"), ("nothing", "1", "not a field"),
                                              ("fuse", "maybe", "true/false"), ("mixed_precision", "fp8", "bf16")])
def test_a_bad_value_says_what_the_field_takes(name, text, says):
    with pytest.raises(ValueError, match=says):
        parse_field(name, text)


def test_a_value_config_refuses_is_a_one_line_error(capsys):
    """argparse parses the type; Config's own check (overlap needs the joint graph) speaks through the command."""
    assert main(["show", "examples/gpt.py:factory", "--overlap", "late_waits"]) == 2
    assert "needs joint_graph=True" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["show", "examples/gpt.py:factory", "--microbatches", "many"])
    assert "Config.microbatches takes an int" in capsys.readouterr().err


def test_plan_carries_the_flags_it_does_not_search_into_its_config(capsys):
    args = ["plan", "--layers", "4", "--hidden", "256", "--heads", "8", "--batch", "8", "--gpus", "2", "--json"]
    assert main([*args, "--joint-graph", "--overlap", "late_waits", "--bucket-mb", "5", "--vpp", "1"]) == 0
    config = json.loads(capsys.readouterr().out)["fxpar"]["config"]
    assert config["joint_graph"] is True and config["overlap"] == ["late_waits"] and config["bucket_mb"] == 5.0
    assert Config.from_dict(config).overlap == ("late_waits",) and config["virtual_stages"] == 1


def test_check_builds_its_config_from_the_flags():
    from fxpar.check import CheckSpec
    from fxpar.cli.config_flags import config_overrides

    args = build_parser().parse_args(["check", "gpt", "--pp", "2", "--vpp", "2", "--no-fuse", "--zero", "1"])
    spec = CheckSpec(args.target, pp=args.pp, config=config_overrides(args))
    c = spec.parallel_config()
    assert (c.virtual_stages, c.microbatches, c.schedule, c.fuse, c.zero) == (2, 8, "interleaved-1f1b", False, 1)
    with pytest.raises(ValueError, match="--seed or --precision"):
        CheckSpec("gpt", config={"seed": 3})
    with pytest.raises(ValueError, match="fxpar check: Config.zero"):
        CheckSpec("gpt", config={"zero": 2})
