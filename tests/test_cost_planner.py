"""Planner: valid candidates only, ranked by predicted time, rejections explained, the paper's rule."""
import json
from pathlib import Path

import pytest

from fxpar.cost.cluster import get_cluster
from fxpar.cost.planner import REASONS, SearchSpace, plan
from fxpar.cost.shape import ModelShape

REFERENCE = Path(__file__).resolve().parent / "data" / "megatron.json"  # the papers' numbers (tests/data/README.md)


def table1():
    table = json.loads(REFERENCE.read_text())["ptdp_table1"]
    for row in table["rows"]:
        r = dict(zip(table["columns"], row))
        yield r, ModelShape(layers=r["layers"], hidden=r["hidden"], heads=r["heads"], seq=2048, vocab=51200,
                            batch=r["batch"])


def test_planner_is_no_slower_than_the_papers_configuration_and_follows_its_rule():
    selene = get_cluster("selene")
    for r, shape in table1():
        result = plan(shape, r["gpus"], selene)
        paper = plan(shape, r["gpus"], selene, SearchSpace(tp=r["tp"], pp=r["pp"], recompute=("full",))).best
        assert result.best.seconds <= paper.seconds, (r, result.best.config, paper.config)
        assert any(e.config == paper.config for e in result.ranked), "the paper's configuration was rejected"
        spans_nodes = r["tp"] * r["pp"] > selene.gpus_per_node
        # the planner agrees with the paper on which models do not fit in one node ...
        assert bool(result.notes) == spans_nodes, (r, result.notes)
        if spans_nodes:  # ... and then uses t = GPUs per node with a pipeline across nodes
            for e in result.ranked:
                assert e.config.tp == selene.gpus_per_node and e.config.tp * e.config.pp > selene.gpus_per_node


def test_candidates_obey_every_rule():
    shape = ModelShape(layers=30, hidden=3072, heads=32, seq=2048, vocab=51200, batch=96)
    selene = get_cluster("selene")
    result = plan(shape, 16, selene)
    assert result.ranked
    for e in result.ranked:
        c = e.config
        m = shape.batch // (c.dp * c.microbatch)
        assert c.gpus == 16 and c.tp <= 8 and shape.heads % c.tp == 0 and shape.layers >= c.pp * c.vpp
        assert shape.batch % (c.dp * c.microbatch) == 0 and (c.vpp == 1 or m % c.pp == 0) and e.fits
    assert [e.seconds for e in result.ranked] == sorted(e.seconds for e in result.ranked)


def test_rejections_are_counted_with_an_example():
    shape = ModelShape(layers=4, hidden=3072, heads=24, seq=2048, vocab=51200, batch=12)
    result = plan(shape, 16, get_cluster("selene"))
    rejected = result.rejected
    count, example = rejected[REASONS["tp_per_node"]]
    assert count == 1 and example.startswith("t=16")
    count, example = rejected[REASONS["layers"]]
    knobs = dict(part.split("=") for part in example.split() if "=" in part)
    assert count > 0 and int(knobs["p"]) * int(knobs["v"]) > shape.layers, example
    assert rejected[REASONS["batch_dp"]][0] > 0
    assert REASONS["heads"] not in rejected  # 24 heads divide by 1, 2, 4, 8


def test_pinned_tp_and_pp_are_estimated_with_b_and_v_chosen():
    shape = ModelShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
    result = plan(shape, 1024, get_cluster("selene"), SearchSpace(tp=8, pp=8))
    assert {(e.config.tp, e.config.pp) for e in result.ranked} == {(8, 8)}
    assert len({(e.config.microbatch, e.config.vpp) for e in result.ranked}) > 1


@pytest.mark.parametrize("space,message", [
    (SearchSpace(tp=3), r"--tp 3: heads 32 not divisible by 3; nearby valid: 2, 4"),
    (SearchSpace(pp=8, vpp=4), r"--pp 8 --vpp 4: layers 24 < pp\*vpp = 32; nearby valid: vpp <= 3 or pp <= 6"),
    (SearchSpace(pp=3), r"--pp 3: gpus 64 not divisible by 3; nearby valid: 2, 4"),
    (SearchSpace(pp=1, vpp=2), r"--vpp 2 needs pipeline parallelism"),
])
def test_bad_pins_raise_a_clear_error(space, message):
    shape = ModelShape(layers=24, hidden=2048, heads=32, seq=2048, vocab=51200, batch=64)
    with pytest.raises(ValueError, match=message):
        plan(shape, 64, get_cluster("selene"), space)


def test_a_model_that_fits_nowhere_says_what_it_needs():
    shape = ModelShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=64)
    with pytest.raises(ValueError, match=r"fits nowhere on 8 GPUs of selene: the smallest configuration "
                                         r"\(t=8 p=1 .*\) needs \d+\.\d GiB per GPU, a GPU has 80\.0 GiB"):
        plan(shape, 8, get_cluster("selene"))


def test_search_space_validates_itself():
    with pytest.raises(ValueError, match="recompute must be one of"):
        SearchSpace(recompute=("sometimes",))
    with pytest.raises(ValueError, match="SearchSpace.tp"):
        SearchSpace(tp=-1)
