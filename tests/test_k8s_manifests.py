"""Every manifest under deploy/k8s/ is a valid object of its Kubernetes API kind.

Each document is validated by the ``kubernetes`` package's models (required fields, types), then
serialised back: a key the model does not know is dropped on the way, so any key of the file that
is missing from the round trip is an unknown field (a typo Kubernetes would reject or ignore).
KubeRay's RayCluster is a custom resource: its pod templates are validated as V1PodTemplateSpec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client as k8s  # noqa: E402

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MODELS = {
    ("v1", "Namespace"): k8s.V1Namespace,
    ("v1", "Service"): k8s.V1Service,
    ("apps/v1", "DaemonSet"): k8s.V1DaemonSet,
    ("apps/v1", "Deployment"): k8s.V1Deployment,
    ("networking.k8s.io/v1", "NetworkPolicy"): k8s.V1NetworkPolicy,
}


def documents() -> list[tuple[str, int, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((path.name, i, doc))
    return out


DOCS = documents()


def unknown_keys(original: Any, roundtrip: Any, where: str = "$") -> list[str]:
    if isinstance(original, dict):
        if not isinstance(roundtrip, dict):
            return [where]
        out = []
        for k, v in original.items():
            if k not in roundtrip:
                out.append(f"{where}.{k}")
            else:
                out += unknown_keys(v, roundtrip[k], f"{where}.{k}")
        return out
    if isinstance(original, list):
        if not isinstance(roundtrip, list) or len(roundtrip) != len(original):
            return [where]
        return [x for i, (a, b) in enumerate(zip(original, roundtrip)) for x in unknown_keys(a, b, f"{where}[{i}]")]
    return []


def validate(doc: dict[str, Any], model: Any, where: str) -> Any:
    obj = model.from_dict(doc)
    back = k8s.ApiClient().sanitize_for_serialization(obj)
    bad = unknown_keys(doc, back)
    assert not bad, f"{where}: fields the {model.__name__} model does not know: {bad}"
    return obj


def test_there_are_manifests_for_node_gateway_and_ray():
    kinds = {doc["kind"] for _, _, doc in DOCS}
    assert {"DaemonSet", "Deployment", "Service", "NetworkPolicy", "RayCluster", "Namespace"} <= kinds


@pytest.mark.parametrize("name, index, doc", DOCS, ids=[f"{n}[{i}]" for n, i, _ in DOCS])
def test_each_manifest_is_a_valid_object_of_its_kind(name, index, doc):
    where = f"{name}[{index}]"
    assert doc.get("metadata", {}).get("name"), f"{where}: metadata.name is required"
    if doc["kind"] == "RayCluster":
        assert doc["apiVersion"] == "ray.io/v1"
        spec = doc["spec"]
        assert spec["rayVersion"] and "rayStartParams" in spec["headGroupSpec"]
        validate(spec["headGroupSpec"]["template"], k8s.V1PodTemplateSpec, f"{where}.headGroupSpec")
        for g in spec["workerGroupSpecs"]:
            assert g["groupName"] and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
            validate(g["template"], k8s.V1PodTemplateSpec, f"{where}.workerGroupSpecs[{g['groupName']}]")
        return
    model = MODELS.get((doc["apiVersion"], doc["kind"]))
    assert model is not None, f"{where}: no model for {doc['apiVersion']} {doc['kind']}"
    validate(doc, model, where)


def test_unknown_fields_are_caught():
    doc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"selector": {"a": "b"}, "ports": [{"port": 80, "targetPrt": 8080}]}}
    with pytest.raises(AssertionError, match=r"spec.ports\[0\].targetPrt"):
        validate(doc, k8s.V1Service, "test")


def _by_kind(kind: str) -> dict[str, Any]:
    [doc] = [d for _, _, d in DOCS if d["kind"] == kind]
    return doc


def _host_paths(pod_spec: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {v["name"]: (v["hostPath"]["path"], v["hostPath"].get("type", "")) for v in pod_spec["volumes"]
            if "hostPath" in v}


@pytest.mark.parametrize("kind", ["DaemonSet", "RayCluster"])
def test_node_pods_are_privileged_with_home_fuse_and_cgroups(kind):
    doc = _by_kind(kind)
    if kind == "DaemonSet":
        pod = doc["spec"]["template"]["spec"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    else:
        pod = doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    paths = _host_paths(pod)
    assert ("/dev/fuse", "CharDevice") in paths.values()
    assert ("/sys/fs/cgroup", "Directory") in paths.values()
    home = [n for n, (p, _) in paths.items() if p == "/var/lib/weenv"]
    assert home
    runner = pod["containers"][0]
    assert runner["securityContext"]["privileged"] is True
    assert {"name": "WEENV_HOME", "value": "/var/lib/weenv"} in runner["env"]
    mounts = {m["mountPath"]: m for m in runner["volumeMounts"]}
    assert mounts["/var/lib/weenv"]["name"] == home[0] and mounts["/var/lib/weenv"]["mountPropagation"] == "Bidirectional"
    assert "/dev/fuse" in mounts and "/sys/fs/cgroup" in mounts


def test_the_node_api_is_reachable_from_the_gateway_only():
    ds, policy, deploy = _by_kind("DaemonSet"), _by_kind("NetworkPolicy"), _by_kind("Deployment")
    node_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= node_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}  # no ipBlock, no namespaceSelector: nothing from outside
    gateway_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    api_ports = {p["containerPort"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert {p["port"] for p in rule["ports"]} == api_ports


def test_the_gateway_service_selects_the_gateway_pods():
    svc, deploy = _by_kind("Service"), _by_kind("Deployment")
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    names = {p["name"] for c in deploy["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
