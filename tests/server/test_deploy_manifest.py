"""deploy/kubernetes/prefixserve-cluster.yaml is well-formed and its ports and labels agree."""
from __future__ import annotations

import pathlib

import pytest

yaml = pytest.importorskip("yaml")

MANIFEST = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "prefixserve-cluster.yaml"


def _docs() -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert all({"apiVersion", "kind", "metadata"} <= d.keys() for d in docs)
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_manifest_ports_and_labels_agree():
    docs = _docs()
    workers = docs[("StatefulSet", "prefixserve-worker")]["spec"]
    worker = workers["template"]["spec"]["containers"][0]
    assert worker["command"] == ["prefixserve", "serve"]
    port = int(_flag(worker["args"], "--port"))
    assert {p["containerPort"] for p in worker["ports"]} == {port}
    assert worker["readinessProbe"]["httpGet"]["path"] == "/health"
    labels = workers["template"]["metadata"]["labels"]
    assert workers["selector"]["matchLabels"] == labels
    headless = docs[("Service", workers["serviceName"])]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == labels
    assert {p["port"] for p in headless["ports"]} == {port}
    # Longer than the worker's drain (30 s by default), so SIGTERM drains before the kill.
    assert workers["template"]["spec"]["terminationGracePeriodSeconds"] > 30

    gateway_spec = docs[("Deployment", "prefixserve-gateway")]["spec"]["template"]
    gateway = gateway_spec["spec"]["containers"][0]
    args = gateway["args"]
    assert gateway["command"][-1] == "smg.launch_router"
    selector = _flag(args, "--selector")
    assert selector == "=".join(next(iter(labels.items())))
    assert int(_flag(args, "--service-discovery-port")) == port
    gateway_port = int(_flag(args, "--port"))
    assert {p["containerPort"] for p in gateway["ports"]} == {gateway_port}
    front = docs[("Service", "prefixserve")]["spec"]
    assert front["selector"] == gateway_spec["metadata"]["labels"]
    assert all(p["targetPort"] in ("http", gateway_port) for p in front["ports"])
    # The gateway may list pods (its service discovery).
    role = docs[("Role", gateway_spec["spec"]["serviceAccountName"])]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and "pods" in role["rules"][0]["resources"]


def test_gateway_flags_are_ones_smg_knows():
    smg_args = pytest.importorskip("smg.router_args")
    import argparse

    parser = argparse.ArgumentParser()
    smg_args.RouterArgs.add_cli_args(parser) if hasattr(smg_args, "RouterArgs") else pytest.skip("smg layout")
    gateway = _docs()[("Deployment", "prefixserve-gateway")]["spec"]["template"]["spec"]["containers"][0]
    parser.parse_args(gateway["args"])  # exits (SystemExit) on a flag smg does not have
