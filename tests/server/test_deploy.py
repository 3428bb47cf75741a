"""The manifests in deploy/: every object validates against the Kubernetes schemas (kubernetes-validate, strict) or,
for the LeaderWorkerSet, against its CRD's schema (vendored, tests/data/README.md) with its pod templates checked
as strict Pods; every jaxserve container's arguments parse with jaxserve's own parser and its probes point at the
health endpoints; and the multi-host start-up the LeaderWorkerSet describes (the coordinator at the leader's
address, process ids from the pod index) runs with two local processes."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server_harness import REPO, free_port, server_env

K8S_VERSION = "1.37.0"
LWS_SCHEMA = Path(__file__).parents[1] / "data" / "lws-v0.10.0-leaderworkerset-v1.schema.json.gz"


def manifests() -> list[tuple[str, dict]]:
    return [(p.name, doc) for p in sorted((REPO / "deploy").glob("*.yaml"))
            for doc in yaml.safe_load_all(p.read_text()) if doc]


def pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]]
    return []


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container arguments."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


LWS_ENV = {"LWS_LEADER_ADDRESS": "jaxserve-multihost-0.jaxserve-multihost", "LWS_GROUP_SIZE": "2",
           "LWS_WORKER_INDEX": "1"}


def test_every_object_validates_against_its_schema():
    docs = manifests()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "LeaderWorkerSet", "StatefulSet"}
    lws_schema = json.loads(gzip.decompress(LWS_SCHEMA.read_bytes()))
    for name, doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            jsonschema.validate(doc, lws_schema)
            for template in pod_templates(doc):  # the CRD's pod schema allows unknown fields: check them strictly
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                                              "spec": template["spec"]}, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # The validators do catch mistakes: a misspelt field, and a wrong type in the LeaderWorkerSet.
    deployment = next(d for _, d in docs if d["kind"] == "Deployment")
    bad = dict(deployment, spec=dict(deployment["spec"], replica=1))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    lws = next(d for _, d in docs if d["kind"] == "LeaderWorkerSet")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(lws, spec=dict(lws["spec"], replicas="two")), lws_schema)


def test_containers_parse_and_probe_the_health_endpoints():
    from jaxserve.server.args import parse_args

    for name, doc in manifests():
        for template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                assert c["command"] == ["jaxserve", "serve"], name
                args = parse_args([expand(a, LWS_ENV) for a in c["args"]])  # exits on a flag jaxserve lacks
                if args.role == "router":
                    assert args.routing == "prefix" and len(args.kv_events_url.split(",")) == 2
                if "readinessProbe" in c:
                    probe = c["readinessProbe"]
                    if args.role == "prefill":  # its gRPC health on the KV port (or /health)
                        assert probe.get("grpc", {}).get("port") == args.kv_port or \
                            probe["httpGet"]["path"] == "/health", name
                        assert c["startupProbe"]["httpGet"]["path"] == "/health", name
                    else:
                        assert probe["httpGet"]["path"] == "/health", name
                    assert c["livenessProbe"]["httpGet"]["path"] == "/live", name
                else:  # a multi-host worker: it serves nothing
                    assert doc["kind"] == "LeaderWorkerSet" and args.process_id == 1


def test_multi_host_start_up_from_the_leaderworkerset_environment():
    """Both pods' command lines, expanded as LeaderWorkerSet's environment would (the leader's name resolving to
    this machine, and a free port for the coordinator), start one jax.distributed program of two processes."""
    from jaxserve.server.args import parse_args

    lws = next(d for _, d in manifests() if d["kind"] == "LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    port = free_port()
    procs = []
    for index, template in enumerate(pod_templates(lws)):
        env = {"LWS_LEADER_ADDRESS": "localhost", "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
        args = parse_args([expand(a, env).replace(":8476", f":{port}") for a in template["spec"]["containers"][0]
                           ["args"]])
        assert (args.coordinator_address, args.num_processes, args.process_id) == (f"localhost:{port}", 2, index)
        code = ("import jax; from sharding import multihost; "
                f"multihost.initialize({args.coordinator_address!r}, {args.num_processes}, {args.process_id}); "
                "print(jax.process_index(), jax.process_count(), multihost.is_leader())")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=server_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(out.split())
    assert outs == [["0", "2", "True"], ["1", "2", "False"]]


def workloads() -> list[tuple[str, dict, dict]]:
    """(file, workload, pod template) for every pod the manifests run."""
    return [(name, doc, t) for name, doc in manifests() for t in pod_templates(doc)]


def test_every_pod_is_hardened():
    """No root, no privilege escalation, no capabilities, the runtime's seccomp filter, a read-only root filesystem
    with writable volumes only where mounted, requests and limits, an image pinned to a version, and keys from a
    Secret (never on the command line)."""
    from jaxserve.server.args import parse_args

    pods = workloads()
    assert len(pods) == 7
    for name, doc, template in pods:
        spec = template["spec"]
        where = f"{name}: {doc['kind']} {doc['metadata']['name']}"
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) > 0, where
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        writable = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            for mount in c.get("volumeMounts", []):
                assert mount.get("readOnly") or mount["name"] in writable, (where, mount)
            assert any(m["mountPath"] == "/tmp" for m in c.get("volumeMounts", [])), where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), (where, kind)
            image = c["image"]
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+", image), (where, image)
            env = {e["name"]: e for e in c.get("env", [])}
            assert "secretKeyRef" in env["JAXSERVE_API_KEY"]["valueFrom"], where
            args = [expand(a, LWS_ENV) for a in c["args"]]
            assert not any(a.startswith(("--api-key", "--admin-api-key", "--cluster-secret")) for a in args), where
            assert not any(a.startswith("--enable-admin-endpoints") for a in args), where
            parsed = parse_args(args)
            assert not parsed.enable_admin_endpoints, where


def test_a_network_policy_guards_every_pod_and_port():
    """Every pod is selected by a NetworkPolicy whose every rule names who may connect (no rule open to all), and
    every port a container opens is admitted by some rule: the API only to a gateway or the router, KV-cache events
    and the jax.distributed coordinator only to the pool's own pods."""
    docs = manifests()
    policies = [d for _, d in docs if d["kind"] == "NetworkPolicy"]
    for name, doc, template in workloads():
        labels = template["metadata"]["labels"]
        mine = [p for p in policies
                if all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())]
        assert mine, f"{name}: no NetworkPolicy selects {labels}"
        admitted: dict[int, list[dict]] = {}
        for policy in mine:
            assert policy["spec"]["policyTypes"] == ["Ingress"], name
            for rule in policy["spec"]["ingress"]:
                assert rule.get("from") and rule.get("ports"), (name, rule)  # no rule admits everyone
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"} and peer["podSelector"]["matchLabels"], (name, peer)
                for port in rule["ports"]:
                    admitted.setdefault(port["port"], []).extend(rule["from"])
        for c in template["spec"]["containers"]:
            for port in c.get("ports", []):
                assert port["containerPort"] in admitted, (name, port)
                peers = [p["podSelector"]["matchLabels"] for p in admitted[port["containerPort"]]]
                if port["name"] in ("kv-events", "kv-replay", "coordinator"):
                    # the pool's own pods: the router, or the group itself; never the gateway's label
                    assert all("jaxserve.io/api-client" not in p for p in peers), (name, port, peers)


def test_the_autoscaler_scales_a_manifest_s_deployment_on_metrics_its_servers_export():
    """autoscaling.yaml's HPA targets a Deployment of the manifests, on the queue and on the objective misses,
    which its pods count: their command lines set --slo-ttft-ms / --slo-tpot-ms."""
    from jaxserve.server.args import parse_args
    from jaxserve.server.metrics import ServerMetrics

    docs = manifests()
    hpa = next(d for _, d in docs if d["kind"] == "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    deployment = next(d for _, d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"])
    args = parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.slo_ttft_ms and args.slo_tpot_ms
    exported = ServerMetrics("m", slo_ttft_s=args.slo_ttft_ms / 1000, slo_tpot_s=args.slo_tpot_ms / 1000).render()
    assert b"jaxserve_slo_violations_total" in exported
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names == ["jaxserve_num_requests_waiting", "jaxserve_slo_violations_per_second"]


def test_hardening_checks_catch_a_weakened_manifest(monkeypatch):
    """The two checks above fail when a manifest drops a guard: root allowed, an image on :latest, a policy rule
    open to everyone."""
    import copy

    original = manifests()

    def weakened(change):
        docs = copy.deepcopy(original)
        change(docs)
        monkeypatch.setattr(sys.modules[__name__], "manifests", lambda: docs)

    def first_pod(docs):
        return next(t for _, d in docs for t in pod_templates(d))

    for change in (lambda docs: first_pod(docs)["spec"]["securityContext"].pop("runAsNonRoot"),
                   lambda docs: first_pod(docs)["spec"]["containers"][0].update(image="jaxserve:latest"),
                   lambda docs: first_pod(docs)["spec"]["containers"][0]["securityContext"].update(
                       readOnlyRootFilesystem=False)):
        weakened(change)
        with pytest.raises(AssertionError):
            test_every_pod_is_hardened()
    weakened(lambda docs: next(d for _, d in docs if d["kind"] == "NetworkPolicy")["spec"]["ingress"][0].pop("from"))
    with pytest.raises(AssertionError):
        test_a_network_policy_guards_every_pod_and_port()
