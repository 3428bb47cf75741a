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
                    assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
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
