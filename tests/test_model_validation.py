"""The model's validation reports stay true: regenerated, they equal the committed files; every
published point cites a checkable source; DeepEP's byte count and the system variants are right.

``python -m tools.validate_model --write`` regenerates the reports after a model change.
"""

from __future__ import annotations

import math

import pytest

from collectives.model import get_system
from collectives.model.moe import ENGINES
from collectives.model.systems import efa_latency_us
from tools import validate_model as vm

KINDS = {"collective": "busbw_gbps", "latency": "time_us"}


@pytest.fixture(scope="module")
def doc():
    return vm.load_points()


@pytest.mark.parametrize("path", list(vm.REPORTS), ids=lambda p: p.name)
def test_committed_report_is_the_generated_one(path):
    # A model change that moves any number makes this fail until the report is regenerated.
    assert path.exists(), f"{path} is missing: run python -m tools.validate_model --write"
    assert path.read_text() == vm.REPORTS[path](), (
        f"{path.name} is stale: run python -m tools.validate_model --write and commit it")


def test_every_point_has_a_source_and_a_usable_shape(doc):
    ids = [p["id"] for p in doc["points"]]
    assert len(ids) == len(set(ids)), "point ids must be unique"
    for p in doc["points"]:
        where = p["id"]
        assert p["source"]["url"].startswith("https://"), f"{where}: source URL"
        assert len(p["source"]["quote"]) > 10, f"{where}: the quoted figure"
        assert p["measured"] > 0 and math.isfinite(p["measured"]), where
        if p["kind"] in KINDS:
            assert p["metric"] == KINDS[p["kind"]], where
            assert isinstance(p["size"], int) and p["size"] > 0, where
            # calibration anchors are single-node; a multi-node one must name the constant fitted on it
            assert not (p["in_sample"] and p["nodes"] > 1 and not p.get("calibrates")), (
                f"{where}: a multi-node point in sample without naming what it calibrates")
        else:
            assert p["kind"] == "moe", where
            assert p.get("engine", "deepep") in ENGINES, f"{where}: engine {p.get('engine')!r}"
            # MoE points are out of sample unless one names the constant fitted on it
            assert not (p["in_sample"] and not p.get("calibrates")), f"{where}: in sample without naming what it fits"
            assert p["experts"] % p["ep"] == 0 and p["ep"] % p["gpus_per_node"] == 0, where
        vm.build_system(p["system"], doc["systems"])  # every system resolves


def test_goal_groups_are_populated(doc):
    # The issue asks for >= 10 multi-node busbw points and >= 4 latency points out of sample.
    points = doc["points"]
    multinode = [p for p in points if p["kind"] == "collective" and p["nodes"] > 1 and p["size"] >= vm.GiB
                 and not p["in_sample"]]
    latency = [p for p in points if p["kind"] == "latency" and not p["in_sample"] and p["nodes"] > 1]
    assert len(multinode) >= 10 and len(latency) >= 4


def test_error_sign_and_mape():
    point = {"kind": "latency"}
    over = vm.Evaluation(point, measured=80.0, predicted=100.0, unit="us", detail="")
    under = vm.Evaluation(point, measured=100.0, predicted=70.0, unit="us", detail="")
    none = vm.Evaluation(point, measured=100.0, predicted=None, unit="us", detail="")
    assert over.error_pct == pytest.approx(25.0) and under.error_pct == pytest.approx(-30.0)
    assert none.error_pct is None
    assert vm.mape([over, under, none]) == pytest.approx(27.5)


def test_deepep_bytes_by_hand():
    # 2 ranks with 2 experts each, top-2 of 4: a rank is missed by C(2,2)/C(4,2) = 1/6 of the
    # subsets, so it receives 2 ranks x 3 tokens x 5/6 = 5 tokens; fp8 = 128 * (1 + 4/128) = 132 B.
    intranode = {"op": "moe_dispatch", "metric": "deepep_nvl_gbps", "tokens": 3, "hidden": 128, "topk": 2,
                 "experts": 4, "ep": 2, "gpus_per_node": 2}
    assert vm.deepep_bytes(intranode) == pytest.approx(5 * 132)
    # 2 nodes of 1 rank: tokens x E[distinct nodes] = 3 x 2 x 5/6 = 5 token copies; bf16 combine 256 B.
    internode = dict(intranode, op="moe_combine", metric="deepep_rdma_gbps", gpus_per_node=1)
    assert vm.deepep_bytes(internode) == pytest.approx(5 * 256)


def test_group_limited_simulation_matches_the_exact_uniform_case():
    # With as many groups as nodes the simulated routing is plain uniform top-k, which has a
    # closed form: the simulation must land on it (a wrong mask or axis would not).
    simulated = vm._deepep_group_limited_nodes(nodes=8, experts=256, topk=8, groups=8)
    assert simulated == pytest.approx(vm._uniform_distinct(8, 8, 256), rel=0.01)
    # Limiting to 4 of 8 groups can only reduce the nodes a token reaches, to at most 4.
    assert vm._deepep_group_limited_nodes(nodes=8, experts=256, topk=8, groups=4) <= 4.0


def test_system_variants(doc):
    p5 = vm.build_system("p5", doc["systems"])
    p5en = get_system("p5en")
    assert p5.nics_per_node == 32 and p5.nic.bandwidth_gbps == pytest.approx(p5en.nic.bandwidth_gbps / 2)
    assert p5.nic_bandwidth_per_node() == pytest.approx(p5en.nic_bandwidth_per_node())
    # aws-ofi-nccl's latency figure: 75 us on p5 and p4de, 35 on p5en (and p6-b200, p5en's link)
    assert p5.nic.latency_us == pytest.approx(efa_latency_us(75.0))
    assert p5.nic.latency_us > p5en.nic.latency_us
    assert p5en.nic.latency_us == pytest.approx(efa_latency_us(35.0))
    assert vm.build_system("p6-b200", doc["systems"]).nic.latency_us == p5en.nic.latency_us
    assert p5.network_protocols == p5en.network_protocols == ("LL", "LL128", "Simple")
    p4de = vm.build_system("p4de", doc["systems"])
    assert p4de.intra == get_system("dgx-a100").intra and p4de.nic.latency_us == p5.nic.latency_us
    assert p4de.network_protocols == ("Simple",)  # aws-ofi-nccl sets NCCL_PROTO=simple on EFA v1
    assert p4de.nic_bandwidth_per_node() == pytest.approx(4 * p5en.nic.bandwidth_gbps / 2)
    with pytest.raises(ValueError, match="unknown override"):
        vm.build_system("x", {"x": {"base": "p5en", "description": "", "why": "", "overrides": {"nic_gbit": 1}}})


def test_sources_not_used_say_why(doc):
    # A source left out must be checkable and give its reason, so that leaving one out is reviewable.
    for s in doc["not_used"]:
        assert s["url"].startswith("https://") and len(s["what"]) > 10 and len(s["why"]) > 10, s
    used = {p["source"]["url"] for p in doc["points"]}
    assert not used & {s["url"] for s in doc["not_used"]}, "a source is both a point and not used"


def test_latency_points_are_grouped_by_network(doc):
    assert vm.network_kind(vm.build_system("p5", doc["systems"])) == "EFA"
    assert vm.network_kind(get_system("p5en")) == "EFA"
    assert vm.network_kind(get_system("dgx-h100")) == "InfiniBand/RoCE"
    assert vm.network_kind(vm.build_system("a100-4hdr", doc["systems"])) == "InfiniBand/RoCE"
    point = {"kind": "latency", "system": "dgx-h100", "nodes": 4}
    hit = vm.Evaluation(point, measured=100.0, predicted=110.0, unit="us", detail="")
    miss = vm.Evaluation(dict(point, system="p5en", nodes=2), measured=100.0, predicted=140.0, unit="us", detail="")
    line = vm._latency_by_network([hit, miss], doc["systems"])
    assert "EFA 0/1 within 25%, MAPE 40.0% (nodes: 2)" in line
    assert "InfiniBand/RoCE 1/1 within 25%, MAPE 10.0% (nodes: 4)" in line


def test_predict_efa_note_quotes_the_validation(doc):
    # moecomm predict's EFA note states three figures of the published points; a model change that
    # moves them must update the note (benchmarks/predict.py EFA_MOE_NOTE).
    from benchmarks.predict import EFA_MOE_NOTE

    errors = {p["id"]: vm.evaluate(p, doc["systems"]).error_pct for p in doc["points"]}
    pplx_efa = max(abs(e) for i, e in errors.items() if i.startswith("pplxgarden-efa-") and "-ep8-" not in i)
    uccl_ll = max(abs(e) for i, e in errors.items() if i.startswith("ucclep-ll-p6-b200-"))
    uccl_normal = -min(e for i, e in errors.items() if i.startswith("ucclep-p") and "-ep8-" not in i)
    assert f"within {math.ceil(pplx_efa)}% at EP16-64" in EFA_MOE_NOTE, pplx_efa
    assert f"p6-b200 table comes out within {math.ceil(uccl_ll)}%" in EFA_MOE_NOTE, uccl_ll
    assert f"up to {round(uccl_normal)}% slower" in EFA_MOE_NOTE, uccl_normal
