"""Clusters as data, and cost/ importing nothing of ours."""
import dataclasses
from pathlib import Path

import pytest

from fxpar.cost.cluster import Cluster, builtin_clusters, get_cluster, load_cluster, save_cluster

COST_DIR = Path(__file__).resolve().parents[1] / "cost"


def test_builtin_clusters():
    clusters = builtin_clusters()
    assert set(clusters) == {"selene", "dgx2h", "h100"}
    assert clusters["selene"].gpus_per_node == 8 and clusters["dgx2h"].gpus_per_node == 16
    assert clusters["selene"].inter_bandwidth == pytest.approx(8 * 200e9 / 8 / 8)  # 8x 200 Gb/s per 8 GPUs
    assert get_cluster("a100") == clusters["selene"] and get_cluster("V100") == clusters["dgx2h"]


def test_cluster_validation_names_the_field():
    with pytest.raises(ValueError, match="gemm_efficiency must be in"):
        dataclasses.replace(builtin_clusters()["selene"], gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="gpus_per_node"):
        dataclasses.replace(builtin_clusters()["selene"], gpus_per_node=0)
    with pytest.raises(ValueError, match="sync_jitter must be >= 0, got -0.1"):
        dataclasses.replace(builtin_clusters()["selene"], sync_jitter=-0.1)


def test_json_round_trip_and_unknown_keys(tmp_path):
    path = save_cluster(builtin_clusters()["h100"], tmp_path / "sub" / "h100.json")
    assert load_cluster(path) == builtin_clusters()["h100"] == get_cluster(str(path))
    with pytest.raises(ValueError, match=r"unknown cluster keys \['bogus'\]"):
        Cluster.from_dict({**builtin_clusters()["h100"].to_dict(), "bogus": 1})


def test_unknown_cluster_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown cluster 'tpu'; choose one of: .*selene"):
        get_cluster("tpu")
    with pytest.raises(ValueError, match="fxpar calibrate --out"):
        get_cluster(str(tmp_path / "missing.json"))
