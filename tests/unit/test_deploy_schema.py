"""deploy/k8s against the Kubernetes API's schemas (offline), and the disruption and shard-placement rules it sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.unit.test_deploy_manifests import (
    SPOT_KEYS,
    SPOT_LABELS,
    Container,
    by_command,
    coordinator,
    k8s_docs,
    node_terms,
    workloads,
)

# The oldest minor still in the clouds' extended support, one between, and the newest the schemas cover.
VERSIONS = ("1.27", "1.30", kubernetes_validate.latest_version())
# GKE: a spot VM's 30 s notice ends in the kubelet's graceful shutdown, which gives non-system pods ~15 s.
GKE_SPOT_POD_S = 15
# EKS: a 2-minute interruption notice; the node termination handler drains at once.
EKS_SPOT_NOTICE_S = 120
GPU_PRESENT = "nvidia.com/gpu.present"


def documents() -> list[tuple[Path, dict[str, Any]]]:
    return k8s_docs()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d[0].name}:{d[1]['kind']}/{d[1]['metadata']['name']}")
def test_every_object_matches_the_kubernetes_api_schema(doc: tuple[Path, dict[str, Any]], version: str) -> None:
    path, obj = doc
    try:
        # strict: an unknown field is an error (the API server would drop it, or refuse it with --validate=strict).
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path)
        pytest.fail(f"{path.name}: {obj['kind']}/{obj['metadata']['name']} at {where or '<top>'} "
                    f"(Kubernetes {version}): {e.message}")


def test_the_schema_check_rejects_an_unknown_field_and_a_wrong_type() -> None:
    # The strict schemas do catch a misspelt field and a string port, or the test above proves nothing.
    base = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
            "spec": {"ports": [{"port": 7070, "protocol": "UDP"}]}}
    kubernetes_validate.validate(base, VERSIONS[-1], strict=True)
    misspelt = {**base, "spec": {"ports": [{"port": 7070, "protocol": "UDP"}], "selectr": {}}}
    string_port = {**base, "spec": {"ports": [{"port": "7070"}]}}
    for bad in (misspelt, string_port):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


# --- disruption budgets --------------------------------------------------------------------------------
def budgets() -> list[dict[str, Any]]:
    return [d for _, d in k8s_docs() if d["kind"] == "PodDisruptionBudget"]


def budget_for(c: Container) -> dict[str, Any]:
    labels = c.workload["spec"]["template"]["metadata"]["labels"]
    found = [b for b in budgets() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
    assert len(found) == 1, f"{c.where}: {len(found)} PodDisruptionBudgets select it"
    return found[0]


def test_every_budget_selects_the_pods_of_exactly_one_workload() -> None:
    assert budgets()
    for b in budgets():
        sel = b["spec"]["selector"]["matchLabels"].items()
        hits = [w["metadata"]["name"] for _, w in workloads() if sel <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(hits) == 1, f"PodDisruptionBudget/{b['metadata']['name']} selects {hits}"


def test_the_coordinator_is_never_evicted_voluntarily() -> None:
    # One replica: a budget allowing one eviction would let every drain take it; 0 makes drains wait
    # for a deliberate `kubectl delete pod`.
    assert budget_for(coordinator())["spec"].get("maxUnavailable") == 0


def test_the_coordinator_stays_off_spot_nodes() -> None:
    for exprs in node_terms(coordinator().pod):
        excluded = {(e["key"], v) for e in exprs if e["operator"] == "NotIn" for v in e["values"]}
        assert set(SPOT_LABELS.items()) <= excluded, f"a node term admits spot nodes: {exprs}"


def shard_hosts() -> list[Container]:
    hosts = [w for w in by_command("worker join") if w.workload["metadata"]["labels"].get("app.kubernetes.io/component")
             == "shard-host"]
    assert hosts, "no shard-host workload in deploy/k8s"
    return hosts


def test_drains_take_one_shard_host_at_a_time() -> None:
    for h in shard_hosts():
        assert budget_for(h)["spec"].get("maxUnavailable") == 1, h.where


# --- where shards live ------------------------------------------------------------------------------
def test_shard_hosts_are_on_demand_cpu_machines() -> None:
    for h in shard_hosts():
        assert not h.args.spot, f"{h.where}: --spot would make the coordinator place shards elsewhere first"
        assert not any("gpu" in k for k in h.spec["resources"].get("limits", {})), h.where
        assert not any("gpu" in t["key"] for t in h.pod.get("tolerations", [])), f"{h.where}: tolerates GPU nodes"
        for exprs in node_terms(h.pod):  # terms are ORed: each one must exclude GPU and spot nodes
            excluded = {(e["key"], v) for e in exprs if e["operator"] == "NotIn" for v in e["values"]}
            assert (GPU_PRESENT, "true") in excluded, f"{h.where}: a node term admits GPU nodes"
            assert set(SPOT_LABELS.items()) <= excluded, f"{h.where}: a node term admits spot nodes"
            assert not any(e["operator"] == "In" and e["key"] in SPOT_KEYS for e in exprs), h.where


def test_shard_hosts_name_their_machine_as_a_failure_domain() -> None:
    # The coordinator keeps a shard's replicas out of a shared `rack` (placement.FAILURE_DOMAINS).
    for h in shard_hosts():
        labels = dict(item.split("=", 1) for item in h.args.labels)
        assert labels.get("rack"), f"{h.where}: --labels {h.args.labels}"
        anti = h.pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert any(t["topologyKey"] == "kubernetes.io/hostname" for t in anti), f"{h.where}: two hosts on one machine"


# --- grace periods ----------------------------------------------------------------------------------
def test_spot_workers_leave_within_gkes_spot_shutdown_and_ekss_notice() -> None:
    for w in by_command("worker join"):
        if not w.args.spot:
            continue
        period = w.pod["terminationGracePeriodSeconds"]
        # The agent's --grace ends before the pod's period, and the period within what GKE gives a spot pod
        # (and so within EKS's longer notice too).
        assert w.args.grace < period <= GKE_SPOT_POD_S < EKS_SPOT_NOTICE_S, f"{w.where}: --grace {w.args.grace}, " \
                                                                            f"terminationGracePeriodSeconds {period}"
