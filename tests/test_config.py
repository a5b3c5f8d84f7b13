"""fxpar.Config is keyword-only and checks every field on construction: a wrong type or value raises a ValueError
naming the field and what it got. A new field must come with its bad value here (the table covers every field)."""
from __future__ import annotations

import dataclasses

import pytest

import fxpar
from fxpar.config import Config

BAD = {
    "microbatches": (0, True, 2.0), "virtual_stages": (0, "2"), "schedule": ("zigzag",),
    "scatter_gather": ("yes", 1), "fuse": ("no", 1), "sequence_parallel": ("on", 0), "recompute": ("some",),
    "compile": (1, "inductor"), "joint_graph": ("yes",), "overlap": (("sideways",), "early_collectives"),
    "trace_dir": (3,), "dump_dir": (["a"],), "bucket_mb": (0, -1.0, "25", True), "seed": ("0", 1.5, True),
    "check_replicas_every": (-1, 1.5, True), "zero": (2, True, "1"), "ep_dispatch": ("a2a", None), "mixed_precision": ("bf16",),
}


def test_every_field_has_a_bad_value_here():
    assert set(BAD) == {f.name for f in dataclasses.fields(Config)}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD.items() for v in vs])
def test_a_bad_value_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"Config\.{field}"):
        Config(**{field: value})


def test_positional_construction_is_refused():
    with pytest.raises(TypeError, match="positional"):
        Config(4, 2, "gpipe")


def test_the_defaults_and_a_full_config_construct():
    Config()
    Config(microbatches=4, virtual_stages=2, schedule="interleaved-1f1b", scatter_gather=True, fuse=False,
           sequence_parallel=True, recompute="selective", compile=False, joint_graph=True,
           overlap=("early_collectives",), trace_dir="traces", dump_dir=None, bucket_mb=1, seed=3,
           check_replicas_every=2, zero=1, mixed_precision=fxpar.MixedPrecision())
