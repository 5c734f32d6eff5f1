"""The scaletrain Helm chart: lints clean, renders valid manifests, and deploys the platform the way
cluster operators expect (node-local ckptd, PostgreSQL with a read-only UI user, a trainer launched
as an Indexed Job, a JobSet or a PyTorchJob with hot spares, its rendezvous off the training nodes,
probes, limits, non-root, NetworkPolicies).

Offline: the real Helm v4 engine (helm-python-sdk) renders the chart and kubernetes-validate checks
every manifest against the Kubernetes OpenAPI schemas; no cluster is needed. Each values case is
rendered once per session (`rendered`).
"""

from __future__ import annotations

import argparse
import base64
import copy
import itertools
import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import sqlalchemy as sa
import yaml
from torch.distributed.run import get_args_parser

from scaletrain.app.agent import join_timeout, own_options
from scaletrain.app.stack import ELASTIC_LAST_CALL_S
from scaletrain.cordon import CORDONED_EXIT_CODE
from trainer.options import FULL_WORLD_ENV

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "scaletrain"
# The two newest Kubernetes versions kubernetes-validate knows.
KUBE_VERSIONS = sorted(
    set(kubernetes_validate.utils.all_versions()), key=lambda v: tuple(int(x) for x in v.split("."))
)[-2:]
RELEASE = "st"
NAMESPACE = "ml"
NAME = f"{RELEASE}-scaletrain"
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
# Custom resources kubernetes-validate has no schema for: their shape is asserted instead.
CRD_KINDS = ("JobSet", "PyTorchJob", "ServiceMonitor")

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
PG_URL = "postgresql+psycopg://scaletrain:owner-pw-1@pg.db.svc:5432/scaletrain"
PG_RO_URL = "postgresql+psycopg://reader:reader-pw-2@pg.db.svc:5432/scaletrain"
S3_KEY_ID, S3_SECRET = "AKIAEXAMPLE", "s3-secret-3"
INGRESS = {
    "enabled": True,
    "className": "nginx",
    "hosts": [{"host": "train.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}],
    "tls": [{"secretName": "train-tls", "hosts": ["train.example.com"]}],
}


def case_values(database: str, ingress: bool, launcher: str, nodes: int) -> dict[str, Any]:
    """Values of one point of the matrix; the other settings vary along with it."""
    values: dict[str, Any] = {
        "trainer": {
            "launcher": launcher,
            "nodes": nodes,
            "nprocPerNode": 8,
            "parallel": {"dpReplicate": 2, "tp": 4},
        },
        "ui": {"ingress": INGRESS if ingress else {"enabled": False}},
    }
    if database == "external":
        values["postgresql"] = {"enabled": False}
        values["telemetry"] = {"database": {"url": PG_URL}}
        values["ui"]["database"] = {"url": PG_RO_URL}
    if nodes > 1:
        values["trainingNodes"] = {
            "nodeSelector": {"node.kubernetes.io/instance-type": "h200x8"},
            "tolerations": [GPU_TOLERATION],
        }
        values["ckptd"] = {
            "storage": {"type": "hostPath", "hostPath": "/mnt/nvme/scaletrain"},
            "s3": {
                "endpoint": "https://s3.eu-west-1.amazonaws.com",
                "bucket": "ckpt",
                "region": "eu-west-1",
                "credentials": {"accessKeyId": S3_KEY_ID, "secretAccessKey": S3_SECRET},
            },
        }
        values["serviceMonitor"] = {"enabled": True, "labels": {"release": "prom"}}
    return values


MATRIX = {
    f"{database}-pg/ingress-{'on' if ingress else 'off'}/{launcher}/{nodes}-nodes": case_values(
        database, ingress, launcher, nodes
    )
    for database, ingress, launcher, nodes in itertools.product(
        ("bundled", "external"), (False, True), ("Job", "JobSet", "PyTorchJob"), (1, 16)
    )
}
CASES: dict[str, dict[str, Any]] = {"defaults": {}, **MATRIX}
BIG_JOB = "bundled-pg/ingress-on/Job/16-nodes"
# The other ways ckptd finds its peers; the defaults find them through the headless Service.
STATIC_PEERS = ["ckpt-0.example.com:50051", "10.0.3.7:50051", "[fd00::7]:50051"]
CKPTD_CLUSTER_CASES: dict[str, dict[str, Any]] = {
    "ckptd-static-peers": {"ckptd": {"cluster": {"peers": STATIC_PEERS}}},
    "ckptd-cluster-off": {"ckptd": {"cluster": {"enabled": False}}},
}
CLUSTER_FLAGS = ("--node", "--advertise", "--peers", "--peers-dns", "--replicas", "--replica-mb-s")
# Hot spares on each launcher, a single node's included, placed like the big job's nodes.
SPARES_CASES: dict[str, dict[str, Any]] = {
    f"{launcher}/{nodes}-nodes+{spares}-spares": {
        "trainer": {"launcher": launcher, "nodes": nodes, "spares": spares, "nprocPerNode": 8},
        "trainingNodes": CASES[BIG_JOB]["trainingNodes"],
    }
    for launcher, (nodes, spares) in itertools.product(
        ("Job", "JobSet", "PyTorchJob"), ((1, 1), (16, 2))
    )
}


@cache
def rendered_raw(case: str) -> dict[str, str]:
    with helm.Chart.load(CHART_DIR) as chart:
        return render_raw(chart, (CASES | CKPTD_CLUSTER_CASES | SPARES_CASES)[case])


@cache
def rendered(case: str) -> list[dict]:
    """The manifests of one of CASES, rendered once per test session."""
    return parse(rendered_raw(case))


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render_raw(chart: helm.Chart, values: dict[str, Any], release: str = RELEASE) -> dict[str, str]:
    return chart.render(values, name=release, namespace=NAMESPACE, is_install=True)


def parse(files: dict[str, str]) -> list[dict]:
    return [
        doc
        for path, text in files.items()
        if not path.endswith(".txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def component_of(doc: dict) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def of_kind(docs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    return [
        d for d in docs if d["kind"] == kind and (component is None or component_of(d) == component)
    ]


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = of_kind(docs, kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def workload(docs: list[dict], component: str) -> dict:
    found = [d for d in docs if d["kind"] in WORKLOAD_KINDS and component_of(d) == component]
    assert len(found) == 1, f"expected one workload for {component}, got {len(found)}"
    return found[0]


def pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a workload, a JobSet or a PyTorchJob."""
    if doc["kind"] == "JobSet":
        return [job["template"]["spec"]["template"] for job in doc["spec"]["replicatedJobs"]]
    if doc["kind"] == "PyTorchJob":
        return [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    return [doc["spec"]["template"]]


def pod_spec(doc: dict) -> dict:
    (template,) = {json.dumps(t, sort_keys=True): t for t in pod_templates(doc)}.values()
    return template["spec"]


def container(doc: dict) -> dict:
    (only,) = pod_spec(doc)["containers"]
    return only


def trainer(docs: list[dict]) -> dict:
    found = [d for d in docs if component_of(d) == "trainer" and d["kind"] != "NetworkPolicy"]
    (launcher,) = [d for d in found if d["kind"] in ("Job", "JobSet", "PyTorchJob")]
    return launcher


def client_service(docs: list[dict], component: str) -> dict:
    """The Service a component's clients dial (ckptd and PostgreSQL also have a headless one)."""
    services = [
        s for s in of_kind(docs, "Service", component) if s["spec"].get("clusterIP") != "None"
    ]
    return one(services, "Service")


def headless_services(docs: list[dict], component: str) -> list[dict]:
    return [s for s in of_kind(docs, "Service", component) if s["spec"].get("clusterIP") == "None"]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} must appear once in {argv}"
    return argv[argv.index(name) + 1]


def secret_ref(c: dict, variable: str) -> tuple[str, str]:
    ref = env_of(c)[variable]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def secret_data(secret: dict) -> dict[str, str]:
    decoded = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return decoded | secret.get("stringData", {})


def all_containers(docs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(where, pod spec, container) of every pod template in the manifests."""
    for doc in docs:
        if doc["kind"] in (*WORKLOAD_KINDS, "JobSet", "PyTorchJob"):
            for template in pod_templates(doc):
                spec = template["spec"]
                for c in spec.get("initContainers", []) + spec["containers"]:
                    yield f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}", spec, c


# --- lint and Kubernetes validity ---------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_chart_passes_strict_helm_lint(case: str) -> None:
    report = helm.lint(CHART_DIR, CASES[case], strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_is_valid_kubernetes_on_the_two_newest_versions(case: str) -> None:
    docs = rendered(case)
    assert len(KUBE_VERSIONS) == 2
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert len(doc["metadata"]["name"]) <= 63
        if doc["kind"] in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("case", [c for c in CASES if "/Job/" not in c and c != "defaults"])
def test_custom_resources_embed_valid_jobs_and_pods(case: str) -> None:
    """JobSet and PyTorchJob are CRDs: the Job and pod templates inside them are validated."""
    launcher = trainer(rendered(case))
    if launcher["kind"] == "JobSet":
        assert launcher["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
        embedded = [
            {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **j["template"]}
            for j in launcher["spec"]["replicatedJobs"]
        ]
    else:
        assert launcher["apiVersion"] == "kubeflow.org/v1"
        embedded = [
            {"apiVersion": "v1", "kind": "Pod", **r["template"]}
            for r in launcher["spec"]["pytorchReplicaSpecs"].values()
        ]
    for doc in embedded:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_long_release_names_keep_object_and_trainer_host_names_within_dns_limits(chart) -> None:
    long_release = "a-very-long-release-name-for-a-large-pretraining-run-2026"
    for launcher, last_pod in (("Job", "-15"), ("JobSet", "-node-0-15")):
        values = {"trainer": {"nodes": 16, "launcher": launcher}}
        docs = parse(render_raw(chart, values, release=long_release))
        for doc in docs:
            assert len(doc["metadata"]["name"]) <= 63
        assert len(trainer(docs)["metadata"]["name"] + last_pod) <= 63


# --- trainer --------------------------------------------------------------------------------------


def torchrun_and_trainer_args(c: dict) -> tuple[list[str], list[str]]:
    # torchrun less torch 2.13's crash on a spare the job ended without: it takes torchrun's args.
    assert c["command"] == ["python", "-m", "scaletrain.app.agent"]
    argv = c["args"]
    module_at = argv.index("-m")
    assert argv[module_at + 1] == "trainer"
    return argv[:module_at], argv[module_at + 2 :]


def pods_of(launcher: dict) -> int:
    """The trainer pods a launcher runs at once, spares included."""
    spec = launcher["spec"]
    if launcher["kind"] == "Job":
        assert spec["completionMode"] == "Indexed"
        assert spec["parallelism"] == spec["completions"]
        return spec["parallelism"]
    if launcher["kind"] == "JobSet":
        (job,) = spec["replicatedJobs"]
        assert job["replicas"] == 1
        assert job["template"]["spec"]["completionMode"] == "Indexed"
        assert job["template"]["spec"]["parallelism"] == job["template"]["spec"]["completions"]
        return job["template"]["spec"]["parallelism"]
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    return 1 + replicas.get("Worker", {"replicas": 0})["replicas"]


@pytest.mark.parametrize("case", MATRIX)
def test_every_launcher_runs_one_pod_per_node_with_a_gpu_per_process(case: str) -> None:
    nodes = CASES[case]["trainer"]["nodes"]
    launcher = trainer(rendered(case))
    assert pods_of(launcher) == nodes
    if launcher["kind"] == "PyTorchJob":
        assert launcher["spec"]["nprocPerNode"] == "8"
        assert container(launcher)["name"] == "pytorch"
    c = container(launcher)
    torchrun, _ = torchrun_and_trainer_args(c)
    assert flag(torchrun, "--nnodes") == str(nodes)
    assert flag(torchrun, "--nproc-per-node") == "8"
    for section in ("requests", "limits"):
        assert c["resources"][section]["nvidia.com/gpu"] == 8


@pytest.mark.parametrize("case", SPARES_CASES)
def test_spares_add_pods_to_each_launcher_and_keep_the_rounds_at_nodes(case: str) -> None:
    values = SPARES_CASES[case]["trainer"]
    docs = rendered(case)
    launcher = trainer(docs)
    assert pods_of(launcher) == values["nodes"] + values["spares"]
    torchrun, _ = torchrun_and_trainer_args(container(launcher))
    # min = max = nodes: a round takes the first `nodes` agents, the others wait as spares.
    assert flag(torchrun, "--nnodes") == str(values["nodes"])
    # Spares are placed like the nodes they stand in for.
    spec = pod_spec(launcher)
    assert spec["nodeSelector"] == SPARES_CASES[case]["trainingNodes"]["nodeSelector"]
    assert spec["tolerations"] == SPARES_CASES[case]["trainingNodes"]["tolerations"]
    assert (
        f"+ {values['spares']} hot spare(s)" in rendered_raw(case)["scaletrain/templates/NOTES.txt"]
    )


@pytest.mark.parametrize("case", SPARES_CASES)
def test_spares_lint_and_render_valid_kubernetes(case: str) -> None:
    report = helm.lint(
        CHART_DIR, SPARES_CASES[case], strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}"
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    launcher = trainer(rendered(case))
    if launcher["kind"] == "Job":
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(launcher, version, strict=True)
    for template in pod_templates(launcher):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", **template}, version)


@pytest.mark.parametrize("case", [*MATRIX, *SPARES_CASES])
def test_the_rendezvous_is_a_service_of_its_own_off_the_training_nodes(case: str) -> None:
    docs = rendered(case)
    launcher = trainer(docs)
    c = container(launcher)
    torchrun, _ = torchrun_and_trainer_args(c)
    assert flag(torchrun, "--rdzv-backend") == "c10d"
    # Every agent is a client of the store: none hosts it, so no training pod is indispensable.
    # A lost pod is seen after 3 missed heartbeats, 2 s apart (torch's default takes 15 s).
    assert flag(torchrun, "--rdzv-conf") == (
        "is_host=false,keep_alive_interval=2,keep_alive_max_attempt=3"
    )
    rendezvous = workload(docs, "rendezvous")
    assert rendezvous["kind"] == "Deployment"
    assert rendezvous["spec"]["replicas"] == 1
    # Never two stores behind the Service, not even during a rollout.
    assert rendezvous["spec"]["strategy"] == {"type": "Recreate"}
    store = container(rendezvous)
    assert store["command"] == ["scaletrain", "rendezvous"]
    assert store["args"] == ["--listen", "0.0.0.0:29400"]
    (port,) = store["ports"]
    service = client_service(docs, "rendezvous")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= (
        rendezvous["spec"]["template"]["metadata"]["labels"].items()
    )
    (service_port,) = service["spec"]["ports"]
    assert (service_port["port"], service_port["targetPort"]) == (29400, port["name"])
    fqdn = f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert flag(torchrun, "--rdzv-endpoint") == f"{fqdn}:{service_port['port']}"
    # Off the training nodes: none of their placement, which the trainer pods do have.
    spec = pod_spec(rendezvous)
    placement = CASES.get(case, SPARES_CASES.get(case)).get("trainingNodes")
    assert not {"nodeSelector", "tolerations", "affinity"} & spec.keys()
    assert ("nodeSelector" in pod_spec(launcher)) == (placement is not None)
    # Nothing else serves the trainer pods: they find each other through the store, not DNS.
    assert of_kind(docs, "Service", "trainer") == []
    assert "subdomain" not in pod_spec(launcher)
    assert "network" not in launcher["spec"]
    assert "ports" not in c


@pytest.mark.parametrize("case", ["defaults", *SPARES_CASES])
def test_rank_zero_publishes_its_pod_ip_in_a_store_announced_every_round(case: str) -> None:
    c = container(trainer(rendered(case)))
    torchrun, _ = torchrun_and_trainer_args(c)
    assert flag(torchrun, "--local-addr") == "$(POD_IP)"
    env = env_of(c)
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Unshared, a spare that takes over (or a replaced pod) learns where the ranks' store is.
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"


@pytest.mark.parametrize("case", MATRIX)
def test_a_launcher_created_again_for_the_run_meets_in_a_fresh_rendezvous(case: str) -> None:
    """The store outlives the launcher, and torch closes a rendezvous for good once its agents end:
    the pods of a Job meet under the Job's uid, which its replacement pods share and a Job created
    again (to resume the run) does not. The operator's pods carry no uid of their PyTorchJob."""
    launcher = trainer(rendered(case))
    c = container(launcher)
    torchrun, argv = torchrun_and_trainer_args(c)
    notes = rendered_raw(case)["scaletrain/templates/NOTES.txt"]
    restart = f"rollout restart deployment/{NAME}-rendezvous"
    if launcher["kind"] == "PyTorchJob":
        assert flag(torchrun, "--rdzv-id") == flag(argv, "--run-id") == RELEASE
        assert "JOB_UID" not in env_of(c)
        assert restart in notes
    else:
        assert flag(torchrun, "--rdzv-id") == f"{RELEASE}-$(JOB_UID)"
        assert env_of(c)["JOB_UID"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}
        }
        assert restart not in notes


def test_the_rendezvous_takes_its_own_placement_and_resources(chart) -> None:
    placement = {
        "nodeSelector": {"node-role.example.com/system": "true"},
        "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "spot", "operator": "DoesNotExist"}]}
                    ]
                }
            }
        },
    }
    resources = {
        "requests": {"cpu": "50m", "memory": "256Mi"},
        "limits": {"cpu": "500m", "memory": "768Mi"},
    }
    values = {
        "trainingNodes": CASES[BIG_JOB]["trainingNodes"],
        "trainer": {"rendezvous": {**placement, "resources": resources}},
    }
    docs = parse(render_raw(chart, values))
    rendezvous = workload(docs, "rendezvous")
    spec = pod_spec(rendezvous)
    assert {key: spec[key] for key in placement} == placement
    assert container(rendezvous)["resources"] == resources
    assert (
        pod_spec(trainer(docs))["nodeSelector"] == CASES[BIG_JOB]["trainingNodes"]["nodeSelector"]
    )


@pytest.mark.parametrize("case", MATRIX)
def test_the_launcher_gives_up_when_torchrun_runs_out_of_restarts(case: str) -> None:
    launcher = trainer(rendered(case))
    torchrun, _ = torchrun_and_trainer_args(container(launcher))
    restarts = int(flag(torchrun, "--max-restarts"))
    assert restarts == 3
    spec = launcher["spec"]
    if launcher["kind"] == "Job":
        assert spec["backoffLimit"] == restarts
        assert pod_spec(launcher)["restartPolicy"] == "Never"
        jobs = [spec]
    elif launcher["kind"] == "JobSet":
        assert spec["failurePolicy"]["maxRestarts"] == restarts
        jobs = [j["template"]["spec"] for j in spec["replicatedJobs"]]
        assert [j["backoffLimit"] for j in jobs] == [0]
    else:
        assert spec["runPolicy"]["backoffLimit"] == restarts
        for replica in spec["pytorchReplicaSpecs"].values():
            assert replica["restartPolicy"] == "OnFailure"
        jobs = []
    for job in jobs:
        # A preempted or drained pod, and one that cordoned itself, are replaced without counting.
        assert job["podFailurePolicy"]["rules"] == [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            {
                "action": "Ignore",
                "onExitCodes": {
                    "containerName": "trainer",
                    "operator": "In",
                    "values": [CORDONED_EXIT_CODE],
                },
            },
        ]


@pytest.mark.parametrize("case", SPARES_CASES)
def test_a_pod_whose_ranks_keep_failing_leaves_the_job_by_default_without_api_access(
    case: str,
) -> None:
    docs = rendered(case)
    c = container(trainer(docs))
    cordon_after, torchrun_args = own_options(c["args"])
    assert cordon_after == 3
    assert get_args_parser().parse_args(torchrun_args).training_script == "trainer"
    assert env_of(c)["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    spec = pod_spec(trainer(docs))
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == NAME
    assert of_kind(docs, "ClusterRole") == of_kind(docs, "ClusterRoleBinding") == []


@pytest.mark.parametrize("launcher", ["Job", "JobSet", "PyTorchJob"])
def test_an_elastic_job_meets_in_rounds_of_min_to_max_pods_with_a_short_last_call(
    chart, launcher: str
) -> None:
    values = {"trainer": {"launcher": launcher, "nodes": 4, "minNodes": 2, "capacityWaitS": 90}}
    docs = parse(render_raw(chart, values))
    torchrun, _ = torchrun_and_trainer_args(container(trainer(docs)))
    args = get_args_parser().parse_args([*own_options(torchrun)[1], "-m", "trainer"])
    assert args.nnodes == "2:4"
    assert f"last_call_timeout={ELASTIC_LAST_CALL_S}" in args.rdzv_conf.split(",")
    # Fewer than minNodes pods left, the others wait this long for pods to join, then stop.
    assert join_timeout(args.rdzv_conf) == 90
    assert pods_of(trainer(docs)) == 4
    # Each rank knows the full size: on fewer pods it keeps its micro-batch.
    assert env_of(container(trainer(docs)))[FULL_WORLD_ENV]["value"] == "4"
    # Not elastic: one size, torch's own last call.
    fixed = parse(render_raw(chart, {"trainer": {"launcher": launcher, "nodes": 4}}))
    torchrun, _ = torchrun_and_trainer_args(container(trainer(fixed)))
    assert flag(torchrun, "--nnodes") == "4" and "last_call" not in flag(torchrun, "--rdzv-conf")


def test_an_elastic_hsdp_job_loses_replicas_with_its_pods_and_keeps_its_sharding(chart) -> None:
    parallel = {"dpReplicate": -1, "dpShard": 2}
    values = {"trainer": {"nodes": 4, "minNodes": 2, "nprocPerNode": 2, "parallel": parallel}}
    _, ranks = torchrun_and_trainer_args(container(trainer(parse(render_raw(chart, values)))))
    assert flag(ranks, "--dp-replicate") == "-1" and flag(ranks, "--dp-shard") == "2"


def test_cordon_after_zero_keeps_a_failing_pod_in_the_job(chart) -> None:
    docs = parse(render_raw(chart, {"trainer": {"cordon": {"after": 0}}}))
    assert "--cordon-after" not in container(trainer(docs))["args"]


@pytest.mark.parametrize("launcher", ["Job", "JobSet", "PyTorchJob"])
def test_marking_the_node_unschedulable_takes_an_own_account_that_may_only_patch_nodes(
    chart, launcher: str
) -> None:
    values = {"trainer": {"launcher": launcher, "spares": 1, "cordon": {"markNode": True}}}
    docs = parse(render_raw(chart, values))
    spec = pod_spec(trainer(docs))
    assert spec["automountServiceAccountToken"] is True
    account = one(docs, "ServiceAccount", "trainer")
    assert spec["serviceAccountName"] == account["metadata"]["name"] == f"{NAME}-trainer"
    (role,) = of_kind(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    (binding,) = of_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{NAME}-trainer", "namespace": NAMESPACE}
    ]
    for component in ("ckptd", "telemetry", "ui"):  # no other pod gets the token
        assert pod_spec(workload(docs, component))["automountServiceAccountToken"] is False
    for doc in (account, role, binding):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    report = helm.lint(CHART_DIR, values, strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}")
    assert report["errors"] == []


def test_trainer_takes_its_layout_fp8_recipe_and_services_from_values(chart) -> None:
    values = {
        "trainer": {
            "runId": "llama-8b-r1",
            "nodes": 4,
            "nprocPerNode": 8,
            "steps": 1_000_000,
            "ckptEvery": 500,
            "resume": True,
            "ompNumThreads": 12,
            "parallel": {"dpReplicate": 2, "dpShard": 4, "tp": 2, "pp": 2, "cp": 1, "ep": 2},
            "fp8": {"recipe": "blockwise"},
        }
    }
    docs = parse(render_raw(chart, values))
    c = container(trainer(docs))
    torchrun, argv = torchrun_and_trainer_args(c)
    assert flag(argv, "--run-id") == "llama-8b-r1"
    assert flag(torchrun, "--rdzv-id") == "llama-8b-r1-$(JOB_UID)"
    expected = {
        "--dp-replicate": "2",
        "--dp-shard": "4",
        "--tp": "2",
        "--pp": "2",
        "--cp": "1",
        "--ep": "2",
        "--fp8": "blockwise",
        "--steps": "1000000",
        "--ckpt-every": "500",
        "--ckptd": f"{client_service(docs, 'ckptd')['metadata']['name']}:50051",
        "--telemetry": f"{one(docs, 'Service', 'telemetry')['metadata']['name']}:50052",
    }
    assert {name: flag(argv, name) for name in expected} == expected
    assert "--resume" in argv
    assert env_of(c)["OMP_NUM_THREADS"]["value"] == "12"


@pytest.mark.parametrize("case", [BIG_JOB, "external-pg/ingress-on/PyTorchJob/16-nodes"])
def test_every_command_line_is_one_its_program_accepts(case: str) -> None:
    from scaletrain.app.cli import build_parser
    from trainer.config import from_args, parser

    docs = rendered(case)
    c = container(trainer(docs))
    torchrun = get_args_parser().parse_args(own_options(c["args"])[1])
    assert (torchrun.module, torchrun.training_script) == (True, "trainer")
    assert torchrun.nnodes == "16"
    assert torchrun.rdzv_conf == "is_host=false,keep_alive_interval=2,keep_alive_max_attempt=3"
    config = from_args(parser().parse_args(torchrun.training_script_args))
    assert (config.parallel.dp_replicate, config.parallel.tp) == (2, 4)
    for component in ("ckptd", "telemetry", "ui", "rendezvous"):
        c = container(workload(docs, component))
        assert c["command"][0] == "scaletrain"
        args = build_parser().parse_args(c["command"][1:] + c["args"])
        assert args.command == component


def test_defaults_run_one_process_on_one_node_without_resuming() -> None:
    c = container(trainer(rendered("defaults")))
    torchrun, argv = torchrun_and_trainer_args(c)
    assert flag(argv, "--run-id") == RELEASE
    assert flag(torchrun, "--rdzv-id") == f"{RELEASE}-$(JOB_UID)"
    assert flag(argv, "--fp8") == "none"
    assert flag(argv, "--dp-shard") == "-1"
    assert "--resume" not in argv and "--compile" not in argv


def test_the_compile_value_compiles_the_trainers_blocks(chart) -> None:
    docs = parse(render_raw(chart, {"trainer": {"compile": True, "fp8": {"recipe": "tensorwise"}}}))
    _, argv = torchrun_and_trainer_args(container(trainer(docs)))
    assert "--compile" in argv and flag(argv, "--fp8") == "tensorwise"


def test_trainer_and_ckptd_share_the_training_nodes() -> None:
    docs = rendered(BIG_JOB)
    expected = CASES[BIG_JOB]["trainingNodes"]
    for spec in (pod_spec(trainer(docs)), pod_spec(workload(docs, "ckptd"))):
        assert spec["nodeSelector"] == expected["nodeSelector"]
        assert spec["tolerations"] == expected["tolerations"]


def test_a_cpu_trainer_requests_no_gpu(chart) -> None:
    docs = parse(render_raw(chart, {"trainer": {"gpu": {"enabled": False}, "nprocPerNode": 4}}))
    resources = container(trainer(docs))["resources"]
    assert "nvidia.com/gpu" not in resources["requests"] | resources["limits"]


# --- security, resources, probes ------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_every_container_runs_non_root_read_only_with_requests_and_limits(case: str) -> None:
    for where, spec, c in all_containers(rendered(case)):
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] != 0, where
        assert spec["automountServiceAccountToken"] is False, where
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"] == {"drop": ["ALL"]}, where
        for section in ("requests", "limits"):
            assert {"cpu", "memory"} <= c["resources"][section].keys(), where
        writable = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp["name"] in writable, where


@pytest.mark.parametrize("case", CASES)
def test_every_service_has_startup_liveness_and_readiness_probes(case: str) -> None:
    docs = rendered(case)
    probes = ("startupProbe", "livenessProbe", "readinessProbe")
    for component, port in (("ckptd", 50051), ("telemetry", 50052)):
        c = container(workload(docs, component))
        assert c["command"] == ["scaletrain", component]
        assert flag(c["args"], "--listen") == f"0.0.0.0:{port}"
        assert "--allow-plaintext" in c["args"]  # plaintext off loopback is refused unless allowed
        for probe in probes:
            # Native gRPC probes ask the standard grpc.health.v1 service both servers run.
            assert c[probe]["grpc"] == {"port": port}, (component, probe)
    ui = container(workload(docs, "ui"))
    for probe in probes:
        assert ui[probe]["httpGet"] == {"path": "/_stcore/health", "port": "http"}, probe
    if "external" not in case:
        pg = container(workload(docs, "postgresql"))
        for probe in probes:
            assert "pg_isready" in pg[probe]["exec"]["command"][-1], probe
    # The store speaks no health protocol: that it accepts connections is its health.
    rendezvous = container(workload(docs, "rendezvous"))
    for probe in probes:
        assert rendezvous[probe]["tcpSocket"] == {"port": "rdzv"}, probe


# --- ckptd ----------------------------------------------------------------------------------------


def test_ckptd_is_a_daemonset_behind_a_node_local_service_with_its_s3_tier() -> None:
    docs = rendered(BIG_JOB)
    ckptd = workload(docs, "ckptd")
    assert ckptd["kind"] == "DaemonSet"
    service = client_service(docs, "ckptd")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    c = container(ckptd)
    expected = {
        "--data-dir": "/var/lib/scaletrain/ckptd",
        "--memory-budget-mb": "1024",
        "--s3-endpoint": "https://s3.eu-west-1.amazonaws.com",
        "--s3-bucket": "ckpt",
        "--s3-region": "eu-west-1",
        "--telemetry": f"{one(docs, 'Service', 'telemetry')['metadata']['name']}:50052",
        "--metrics": "0.0.0.0:9101",
    }
    assert {name: flag(c["args"], name) for name in expected} == expected
    (data,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/var/lib/scaletrain/ckptd"]
    (volume,) = [v for v in pod_spec(ckptd)["volumes"] if v["name"] == data["name"]]
    assert volume["hostPath"]["path"] == "/mnt/nvme/scaletrain"
    secrets = {s["metadata"]["name"]: secret_data(s) for s in of_kind(docs, "Secret")}
    name, key = secret_ref(c, "AWS_ACCESS_KEY_ID")
    assert secrets[name][key] == S3_KEY_ID
    name, key = secret_ref(c, "AWS_SECRET_ACCESS_KEY")
    assert secrets[name][key] == S3_SECRET


def test_ckptd_ssd_tier_can_be_a_per_pod_local_volume(chart) -> None:
    values = {"ckptd": {"storage": {"type": "localPV", "localPV": {"storageClass": "nvme"}}}}
    ckptd = workload(parse(render_raw(chart, values)), "ckptd")
    (volume,) = [v for v in pod_spec(ckptd)["volumes"] if v["name"] == "data"]
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "nvme"
    assert claim["resources"]["requests"]["storage"] == "500Gi"


def test_ckptd_uses_irsa_on_its_own_service_account_when_no_keys_are_given(chart) -> None:
    role = "arn:aws:iam::123456789012:role/ckpt"
    values = {
        "ckptd": {
            "s3": {"endpoint": "https://s3.us-east-1.amazonaws.com"},
            "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": role}},
        }
    }
    docs = parse(render_raw(chart, values))
    ckptd = workload(docs, "ckptd")
    accounts = {a["metadata"]["name"]: a for a in of_kind(docs, "ServiceAccount")}
    own = accounts[pod_spec(ckptd)["serviceAccountName"]]
    assert own["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": role}
    for component in ("telemetry", "ui", "trainer"):
        other = pod_spec(workload(docs, component))["serviceAccountName"]
        assert "annotations" not in accounts[other]["metadata"], component
    assert "AWS_ACCESS_KEY_ID" not in env_of(container(ckptd))
    assert of_kind(docs, "Secret", "ckptd") == []


def test_ckptd_uses_an_existing_s3_secret_and_creates_none(chart) -> None:
    credentials = {"existingSecret": "s3-creds", "accessKeyIdKey": "id", "secretAccessKeyKey": "k"}
    values = {"ckptd": {"s3": {"endpoint": "http://seaweedfs:8333", "credentials": credentials}}}
    docs = parse(render_raw(chart, values))
    c = container(workload(docs, "ckptd"))
    assert secret_ref(c, "AWS_ACCESS_KEY_ID") == ("s3-creds", "id")
    assert secret_ref(c, "AWS_SECRET_ACCESS_KEY") == ("s3-creds", "k")
    assert of_kind(docs, "Secret", "ckptd") == []


def test_ckptd_as_a_deployment_is_one_replica_behind_a_cluster_wide_service(chart) -> None:
    docs = parse(render_raw(chart, {"ckptd": {"kind": "Deployment"}}))
    ckptd = workload(docs, "ckptd")
    assert ckptd["kind"] == "Deployment"
    assert ckptd["spec"]["replicas"] == 1
    assert "internalTrafficPolicy" not in one(docs, "Service", "ckptd")["spec"]
    # A single ckptd is a cluster of one: no peers to find, none to admit.
    assert not set(CLUSTER_FLAGS) & set(container(ckptd)["args"])
    assert admitted(docs, "ckptd")["grpc"] == {"trainer"}


def test_ckptd_has_no_s3_tier_and_no_credentials_by_default() -> None:
    c = container(workload(rendered("defaults"), "ckptd"))
    assert not any(a.startswith("--s3-") for a in c["args"])
    assert "AWS_ACCESS_KEY_ID" not in env_of(c)


def test_ckptd_finds_its_peers_through_a_headless_service_of_the_daemonset() -> None:
    docs = rendered("defaults")
    ckptd = workload(docs, "ckptd")
    (peers,) = headless_services(docs, "ckptd")
    spec = peers["spec"]
    assert spec["publishNotReadyAddresses"] is True
    assert spec["selector"].items() <= ckptd["spec"]["template"]["metadata"]["labels"].items()
    c = container(ckptd)
    (port,) = spec["ports"]
    assert (port["port"], port["targetPort"]) == (50051, "grpc")
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in c["ports"]
    env = env_of(c)
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    fqdn = f"{peers['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert {name: flag(c["args"], name) for name in CLUSTER_FLAGS if name in c["args"]} == {
        "--node": "$(NODE_NAME)",
        "--advertise": "$(POD_IP):50051",
        "--peers-dns": f"{fqdn}:{port['port']}",
        "--replicas": "2",
        "--replica-mb-s": "256",
    }
    # Each node's failure domain, from the zone label Kubernetes copies onto the pod.
    assert env["SCALETRAIN_ZONE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.labels['topology.kubernetes.io/zone']"}
    }
    # The trainers' Service is still the node-local one.
    service = client_service(docs, "ckptd")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert peers["metadata"]["name"] != service["metadata"]["name"]
    assert (
        f"Peers: every ckptd pod behind {fqdn}:50051"
        in rendered_raw("defaults")["scaletrain/templates/NOTES.txt"]
    )


def test_a_static_peer_list_replaces_the_dns_lookup() -> None:
    docs = rendered("ckptd-static-peers")
    args = container(workload(docs, "ckptd"))["args"]
    assert flag(args, "--peers") == ",".join(STATIC_PEERS)
    assert "--peers-dns" not in args
    assert (flag(args, "--node"), flag(args, "--advertise")) == ("$(NODE_NAME)", "$(POD_IP):50051")
    assert headless_services(docs, "ckptd") == []


def test_ckptd_without_a_cluster_gets_no_peer_flags_and_no_headless_service() -> None:
    docs = rendered("ckptd-cluster-off")
    c = container(workload(docs, "ckptd"))
    assert not set(CLUSTER_FLAGS) & set(c["args"])
    assert not {"NODE_NAME", "POD_IP", "SCALETRAIN_ZONE"} & env_of(c).keys()
    assert headless_services(docs, "ckptd") == []
    assert client_service(docs, "ckptd")["spec"]["internalTrafficPolicy"] == "Local"


@pytest.mark.parametrize("case", ["defaults", *CKPTD_CLUSTER_CASES])
def test_ckptd_pods_admit_their_peers_on_the_grpc_port(case: str) -> None:
    docs = rendered(case)
    clustered = case != "ckptd-cluster-off"
    assert admitted(docs, "ckptd")["grpc"] == ({"trainer", "ckptd"} if clustered else {"trainer"})
    policy = one(docs, "NetworkPolicy", "ckptd")
    pod_labels = workload(docs, "ckptd")["spec"]["template"]["metadata"]["labels"]
    (grpc,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc"]
    selectors = [p["podSelector"]["matchLabels"] for p in grpc["from"]]
    assert any(s.items() <= pod_labels.items() for s in selectors) is clustered


@pytest.mark.parametrize("case", ["defaults", *CKPTD_CLUSTER_CASES])
def test_ckptd_accepts_its_cluster_flags_once_kubernetes_fills_them_in(case: str) -> None:
    from ckptd.config import ClusterConfig
    from scaletrain.app.cli import build_parser

    c = container(workload(rendered(case), "ckptd"))
    pod = {"NODE_NAME": "gpu-node-07.ec2.internal", "POD_IP": "10.0.3.9"}
    argv = [
        re.sub(r"\$\((\w+)\)", lambda m: pod[m.group(1)], a) for a in c["command"][1:] + c["args"]
    ]
    args = build_parser().parse_args(argv)
    cluster = ClusterConfig(
        node=args.node or "pod-hostname",
        peers=tuple(p for p in args.peers.split(",") if p),
        peers_dns=args.peers_dns,
        advertise=args.advertise,
    )
    if case == "ckptd-cluster-off":
        assert (cluster.peers, cluster.peers_dns, cluster.advertise) == ((), None, None)
    else:
        assert (cluster.node, cluster.advertise) == (pod["NODE_NAME"], "10.0.3.9:50051")
        assert cluster.peers == (tuple(STATIC_PEERS) if case == "ckptd-static-peers" else ())
        assert (cluster.peers_dns is None) == (case == "ckptd-static-peers")


@pytest.mark.parametrize("case", CKPTD_CLUSTER_CASES)
def test_other_ckptd_cluster_settings_lint_and_render_valid_kubernetes(case: str) -> None:
    report = helm.lint(
        CHART_DIR, CKPTD_CLUSTER_CASES[case], strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}"
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    for doc in [d for d in rendered(case) if component_of(d) == "ckptd"]:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


# --- databases and secrets ------------------------------------------------------------------------


def db_url_of(c: dict, secrets: dict[str, dict[str, str]]) -> str:
    """The SCALETRAIN_DB_URL a container sees, with Kubernetes' $(VAR) substitution applied."""
    env = env_of(c)
    values = {}
    for name, entry in env.items():
        if "valueFrom" in entry:
            secret, key = secret_ref(c, name)
            values[name] = secrets[secret][key]
        else:
            values[name] = re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], entry["value"])
    return values["SCALETRAIN_DB_URL"]


def test_bundled_postgresql_gives_telemetry_the_owner_and_the_ui_a_read_only_user() -> None:
    docs = rendered("defaults")
    secrets = {s["metadata"]["name"]: secret_data(s) for s in of_kind(docs, "Secret")}
    (pg_secret,) = secrets.values()
    assert len(pg_secret["password"]) == len(pg_secret["readonly-password"]) == 32
    assert pg_secret["password"] != pg_secret["readonly-password"]
    host = f"{NAME}-postgresql:5432"
    owner = f"postgresql+psycopg://scaletrain:{pg_secret['password']}@{host}/scaletrain"
    reader = (
        f"postgresql+psycopg://scaletrain_ro:{pg_secret['readonly-password']}@{host}/scaletrain"
    )
    assert db_url_of(container(workload(docs, "telemetry")), secrets) == owner
    assert db_url_of(container(workload(docs, "ui")), secrets) == reader
    for component in ("telemetry", "ui"):
        assert "--db" not in container(workload(docs, component))["args"]


def test_bundled_postgresql_is_a_statefulset_with_a_claim_that_outlives_the_release() -> None:
    docs = rendered("defaults")
    pg = workload(docs, "postgresql")
    assert pg["kind"] == "StatefulSet"
    assert pg["spec"]["replicas"] == 1
    headless = [s for s in of_kind(docs, "Service", "postgresql") if s["spec"].get("clusterIP")]
    assert [s["metadata"]["name"] for s in headless] == [pg["spec"]["serviceName"]]
    (claim,) = pg["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    c = container(pg)
    (data,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert env_of(c)["PGDATA"]["value"].startswith(data["mountPath"] + "/")
    secret = one(docs, "Secret", "postgresql")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert of_kind(docs, "PersistentVolumeClaim") == []


def test_external_database_urls_come_from_secrets_with_read_only_credentials_for_the_ui() -> None:
    docs = rendered("external-pg/ingress-off/Job/1-nodes")
    assert of_kind(docs, "StatefulSet") == []
    secrets = {s["metadata"]["name"]: secret_data(s) for s in of_kind(docs, "Secret")}
    assert db_url_of(container(workload(docs, "telemetry")), secrets) == PG_URL
    assert db_url_of(container(workload(docs, "ui")), secrets) == PG_RO_URL


def test_existing_database_secrets_are_referenced_and_none_is_created(chart) -> None:
    values = {
        "postgresql": {"enabled": False},
        "telemetry": {"database": {"existingSecret": "pg-owner", "existingSecretKey": "dsn"}},
        "ui": {"database": {"existingSecret": "pg-reader"}},
    }
    docs = parse(render_raw(chart, values))
    assert of_kind(docs, "Secret") == []
    assert secret_ref(container(workload(docs, "telemetry")), "SCALETRAIN_DB_URL") == (
        "pg-owner",
        "dsn",
    )
    assert secret_ref(container(workload(docs, "ui")), "SCALETRAIN_DB_URL") == ("pg-reader", "url")


def test_without_read_only_credentials_the_ui_falls_back_and_notes_warn(chart) -> None:
    values = {"postgresql": {"enabled": False}, "telemetry": {"database": {"url": PG_URL}}}
    files = render_raw(chart, values)
    docs = parse(files)
    secrets = {s["metadata"]["name"]: secret_data(s) for s in of_kind(docs, "Secret")}
    assert db_url_of(container(workload(docs, "ui")), secrets) == PG_URL
    assert "WARNING: ui.database is empty" in files["scaletrain/templates/NOTES.txt"]
    assert "WARNING" not in rendered_raw("defaults")["scaletrain/templates/NOTES.txt"]


@pytest.mark.parametrize("case", CASES)
def test_secrets_appear_only_in_secrets_never_in_configmaps_or_command_lines(case: str) -> None:
    docs = rendered(case)
    secret_values = {v for s in of_kind(docs, "Secret") for v in secret_data(s).values()}
    secret_values |= {PG_URL, PG_RO_URL, S3_KEY_ID, S3_SECRET, "owner-pw-1", "reader-pw-2"}
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        leaked = [v for v in secret_values if v in text]
        assert leaked == [], f"{doc['kind']}/{doc['metadata']['name']} holds a secret"


@pytest.mark.postgres
def test_the_init_script_creates_a_user_that_reads_tables_created_later_but_cannot_write(
    pg_url: str,
) -> None:
    """The bundled PostgreSQL's init script, run by psql against a real server."""
    script = one(rendered("defaults"), "ConfigMap", "postgresql")["data"]["10-readonly-user.sh"]
    admin = sa.make_url(pg_url)
    suffix = uuid.uuid4().hex[:8]
    owner, reader, db = f"st_owner_{suffix}", f"st_ro_{suffix}", f"st_db_{suffix}"
    admin_engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT")
    with admin_engine.connect() as conn:
        # The image's POSTGRES_USER is a superuser that owns POSTGRES_DB.
        conn.exec_driver_sql(f'CREATE ROLE "{owner}" LOGIN SUPERUSER')
        conn.exec_driver_sql(f'CREATE DATABASE "{db}" OWNER "{owner}"')
    try:
        env = os.environ | {
            "PGHOST": admin.host or "127.0.0.1",
            "PGPORT": str(admin.port or 5432),
            "POSTGRES_USER": owner,
            "POSTGRES_DB": db,
            "SCALETRAIN_READONLY_USER": reader,
            "SCALETRAIN_READONLY_PASSWORD": "reader-pw",
        }
        subprocess.run(["sh", "-c", script], env=env, check=True, capture_output=True, timeout=60)
        with sa.create_engine(admin.set(username=owner, database=db)).begin() as conn:
            conn.exec_driver_sql("CREATE TABLE runs (id int)")
            conn.exec_driver_sql("INSERT INTO runs VALUES (1)")
        read_only = sa.create_engine(admin.set(username=reader, database=db))
        with read_only.connect() as conn:
            assert conn.exec_driver_sql("SELECT id FROM runs").scalars().all() == [1]
        with read_only.connect() as conn, pytest.raises(sa.exc.DBAPIError, match="read-only"):
            conn.exec_driver_sql("INSERT INTO runs VALUES (2)")
        # Even a session that turns read-only transactions off has no right to write.
        writer = read_only.execution_options(isolation_level="AUTOCOMMIT")
        with writer.connect() as conn, pytest.raises(sa.exc.DBAPIError, match="permission denied"):
            conn.exec_driver_sql("SET default_transaction_read_only = off")
            conn.exec_driver_sql("INSERT INTO runs VALUES (2)")
        read_only.dispose()
    finally:
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{reader}"')
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{owner}"')
        admin_engine.dispose()


# --- UI, network policies, monitoring, notes ------------------------------------------------------


def test_ingress_routes_the_configured_host_to_the_ui_service() -> None:
    case = BIG_JOB
    docs = rendered(case)
    ingress = one(docs, "Ingress", "ui")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["train.example.com"], "secretName": "train-tls"}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "train.example.com"
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {
        "name": one(docs, "Service", "ui")["metadata"]["name"],
        "port": {"name": "http"},
    }
    assert "https://train.example.com" in rendered_raw(case)["scaletrain/templates/NOTES.txt"]


@pytest.mark.parametrize("case", [c for c in MATRIX if "ingress-off" in c])
def test_no_ingress_unless_enabled(case: str) -> None:
    assert of_kind(rendered(case), "Ingress") == []


def admitted(docs: list[dict], component: str) -> dict[str, set[str]]:
    """Which components may reach `component`, per port name; "*" is any peer or any port."""
    policy = one(docs, "NetworkPolicy", component)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
    result: dict[str, set[str]] = {}
    for rule in policy["spec"]["ingress"]:
        peers = {
            p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            if "podSelector" in p
            else "*"
            for p in rule.get("from", [{"all": True}])
        }
        for port in rule.get("ports", [{"port": "*"}]):
            result.setdefault(port["port"], set()).update(peers)
    return result


@pytest.mark.parametrize("case", ["defaults", BIG_JOB])
def test_network_policies_admit_only_the_intended_peers(case: str) -> None:
    docs = rendered(case)
    assert admitted(docs, "ckptd") == {"grpc": {"trainer", "ckptd"}, "metrics": {"*"}}
    assert admitted(docs, "telemetry") == {"grpc": {"trainer", "ckptd"}, "metrics": {"*"}}
    assert admitted(docs, "postgresql") == {"postgresql": {"telemetry", "ui"}}
    assert admitted(docs, "ui") == {"http": {"*"}}
    assert admitted(docs, "rendezvous") == {"rdzv": {"trainer"}}
    # The ranks' store on rank 0's pod, and NCCL.
    assert admitted(docs, "trainer") == {"*": {"trainer"}}


@pytest.mark.parametrize("case", ["defaults", BIG_JOB])
def test_service_monitors_scrape_the_metrics_ports_of_ckptd_and_telemetry(case: str) -> None:
    docs = rendered(case)
    monitors = of_kind(docs, "ServiceMonitor")
    if case == "defaults":
        assert monitors == []
    else:
        assert {component_of(m) for m in monitors} == {"ckptd", "telemetry"}
    for component, port in (("ckptd", 9101), ("telemetry", 9102)):
        service = client_service(docs, component)
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["metrics"]["port"] == port
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container(
            workload(docs, component)
        )["ports"]
        for monitor in [m for m in monitors if component_of(m) == component]:
            assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
            assert monitor["metadata"]["labels"]["release"] == "prom"
            assert monitor["spec"]["selector"]["matchLabels"].items() <= (
                service["metadata"]["labels"].items()
            )
            assert monitor["spec"]["endpoints"] == [
                {"port": "metrics", "path": "/metrics", "interval": "30s"}
            ]
    assert flag(container(workload(docs, "telemetry"))["args"], "--metrics") == "0.0.0.0:9102"


def test_telemetry_keeps_per_rank_rows_for_the_window_the_values_set(chart) -> None:
    default = container(workload(parse(render_raw(chart, {})), "telemetry"))
    assert flag(default["args"], "--keep-steps") == "1000"
    values = {"telemetry": {"retention": {"keepSteps": 250_000}}}
    chosen = container(workload(parse(render_raw(chart, values)), "telemetry"))
    assert flag(chosen["args"], "--keep-steps") == "250000"


def test_disabled_components_render_nothing(chart) -> None:
    values = {"trainer": {"enabled": False}, "ui": {"enabled": False}, "ckptd": {"enabled": False}}
    docs = parse(render_raw(chart, values))
    assert {component_of(d) for d in docs} == {None, "telemetry", "postgresql"}


@pytest.mark.parametrize(
    ("launcher", "command"),
    [("Job", "get job"), ("JobSet", "get jobset"), ("PyTorchJob", "get pytorchjob")],
)
def test_notes_say_how_to_open_the_ui_and_follow_the_job(launcher: str, command: str) -> None:
    notes = rendered_raw(f"bundled-pg/ingress-off/{launcher}/1-nodes")[
        "scaletrain/templates/NOTES.txt"
    ]
    assert f"port-forward svc/{NAME}-ui 8501" in notes
    assert f"kubectl -n {NAMESPACE} {command} {NAME}-trainer" in notes
    assert f"Rendezvous: {NAME}-rendezvous.{NAMESPACE}.svc.cluster.local:29400" in notes
    assert (
        f"logs -f -l app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=trainer"
        in (notes)
    )


def test_the_readme_documents_every_value_and_only_values_that_exist() -> None:
    def leaves(tree: dict, prefix: str = "") -> Iterator[str]:
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{path}.")
            else:
                yield path

    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    readme = (CHART_DIR / "README.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, re.MULTILINE))
    paths = set(leaves(values))
    prefixes = {".".join(p.split(".")[:n]) for p in paths for n in range(1, p.count(".") + 2)}

    def is_documented(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:n]) in documented for n in range(1, len(parts) + 1))

    assert [p for p in sorted(paths) if not is_documented(p)] == []
    assert sorted(documented - prefixes) == []


# --- bad input ------------------------------------------------------------------------------------


def with_trainer(**trainer_values: Any) -> dict[str, Any]:
    return {"trainer": trainer_values}


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ({"telemetry": {"replicas": -1}}, helm.HelmValuesError, "at '/telemetry/replicas'"),
        ({"ui": {"replicas": -2}}, helm.HelmValuesError, "at '/ui/replicas'"),
        (with_trainer(nodes=0), helm.HelmValuesError, "at '/trainer/nodes': minimum"),
        (with_trainer(nodes="two"), helm.HelmValuesError, "at '/trainer/nodes'"),
        (with_trainer(spares=-1), helm.HelmValuesError, "at '/trainer/spares': minimum"),
        (with_trainer(spares=1.5), helm.HelmValuesError, "at '/trainer/spares'"),
        (
            with_trainer(rendezvous={"nodeSelector": {"pool": True}}),
            helm.HelmValuesError,
            "at '/trainer/rendezvous/nodeSelector/pool'",
        ),
        (
            with_trainer(fp8={"recipe": "fp4"}),
            helm.HelmValuesError,
            "at '/trainer/fp8/recipe'.*'tensorwise-delayed'",
        ),
        (with_trainer(launcher="MPIJob"), helm.HelmValuesError, "at '/trainer/launcher'"),
        (with_trainer(parallel={"tp": 0}), helm.HelmValuesError, "/trainer/parallel/tp"),
        (with_trainer(node=2), helm.HelmValuesError, "'node' not allowed"),
        ({"ckptd": {"kind": "StatefulSet"}}, helm.HelmValuesError, "/ckptd/kind"),
        (
            {"ckptd": {"cluster": {"peers": ["ckpt-0.example.com"]}}},
            helm.HelmValuesError,
            "at '/ckptd/cluster/peers/0'.*does not match pattern",
        ),
        (
            {"ckptd": {"cluster": {"peers": ["a:50051,b:50051"]}}},
            helm.HelmValuesError,
            "at '/ckptd/cluster/peers/0'",
        ),
        (
            {"ckptd": {"cluster": {"peers": ["a:50051", "a:50051"]}}},
            helm.HelmValuesError,
            "at '/ckptd/cluster/peers': items at 0 and 1 are equal",
        ),
        (
            {"ckptd": {"kind": "Deployment", "cluster": {"peers": ["a:50051"]}}},
            helm.HelmRenderError,
            "ckptd.cluster.peers needs ckptd.kind DaemonSet",
        ),
        (
            {"postgresql": {"auth": {"password": "p@ss/word"}}},
            helm.HelmValuesError,
            "/postgresql/auth/password",
        ),
        (
            with_trainer(nodes=16, nprocPerNode=8, parallel={"dpShard": 8, "tp": 4}),
            helm.HelmRenderError,
            re.escape("world size nodes*nprocPerNode = 16*8 = 128 does not match the layout"),
        ),
        (
            with_trainer(nodes=2, nprocPerNode=3, parallel={"tp": 4}),
            helm.HelmRenderError,
            re.escape("dpReplicate*dpShard*tp*pp*cp = 1*-1*4*1*1"),
        ),
        (
            with_trainer(nodes=1, nprocPerNode=4, parallel={"ep": 3}),
            helm.HelmRenderError,
            "trainer.parallel.ep = 3 must divide dpShard\\*cp = 4",
        ),
        (
            {"ckptd": {"s3": {"endpoint": "http://s3:8333", "credentials": {"accessKeyId": "id"}}}},
            helm.HelmRenderError,
            "set both accessKeyId and secretAccessKey",
        ),
        (
            {"ckptd": {"s3": {"credentials": {"existingSecret": "s3-creds"}}}},
            helm.HelmRenderError,
            "ckptd.s3.endpoint is empty",
        ),
        (
            {"postgresql": {"enabled": False}},
            helm.HelmRenderError,
            "postgresql.enabled is false: set telemetry.database.url",
        ),
        (
            {"telemetry": {"database": {"url": PG_URL}}},
            helm.HelmRenderError,
            "set postgresql.enabled=false to use an external database",
        ),
        (
            {"ckptd": {"enabled": False}},
            helm.HelmRenderError,
            "trainer.enabled needs ckptd.enabled or trainer.ckptdAddress",
        ),
        (
            {"telemetry": {"retention": {"keepSteps": 0}}},
            helm.HelmValuesError,
            "/telemetry/retention/keepSteps",
        ),
        (
            {"trainer": {"nodes": 2, "minNodes": 3}},
            helm.HelmRenderError,
            "trainer.minNodes = 3 must be at most trainer.nodes = 2",
        ),
        (
            {"trainer": {"nodes": 4, "minNodes": 2, "parallel": {"dpShard": 4}}},
            helm.HelmRenderError,
            "trainer.minNodes = 2 needs trainer.parallel.dpShard -1 or dpReplicate -1",
        ),
        (
            {"trainer": {"parallel": {"dpReplicate": -1, "dpShard": -1}}},
            helm.HelmRenderError,
            "dpReplicate and dpShard are both -1",
        ),
    ],
    ids=[
        "negative-telemetry-replicas",
        "negative-ui-replicas",
        "zero-nodes",
        "nodes-not-a-number",
        "negative-spares",
        "fractional-spares",
        "rendezvous-node-selector-not-a-string",
        "unknown-fp8-recipe",
        "unknown-launcher",
        "zero-tensor-parallel",
        "misspelt-key",
        "unknown-ckptd-kind",
        "ckptd-peer-without-port",
        "ckptd-peers-in-one-entry",
        "ckptd-peer-twice",
        "ckptd-static-peers-of-a-deployment",
        "password-not-url-safe",
        "world-size-not-the-layout",
        "world-size-not-divisible-by-the-layout",
        "expert-parallel-not-dividing",
        "half-s3-credentials",
        "s3-credentials-without-endpoint",
        "no-database",
        "two-databases",
        "trainer-without-ckptd",
        "telemetry-keeping-no-steps",
        "elastic-minimum-above-the-nodes",
        "elastic-with-a-fixed-shard-degree",
        "both-data-parallel-degrees-absorbing",
    ],
)
def test_bad_values_are_rejected_with_a_message_naming_them(
    chart, values: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        render_raw(chart, copy.deepcopy(values))


def ckptd_parsed(chart: helm.Chart, values: dict[str, Any]) -> argparse.Namespace:
    """What `scaletrain ckptd` parses from the rendered pod's command line."""
    from scaletrain.app.cli import build_parser

    c = container(workload(parse(render_raw(chart, values)), "ckptd"))
    pod = {"NODE_NAME": "node-1", "POD_IP": "10.0.0.1"}
    argv = [
        re.sub(r"\$\((\w+)\)", lambda m: pod[m.group(1)], a) for a in c["command"][1:] + c["args"]
    ]
    return build_parser().parse_args(argv)


def test_every_fair_share_of_ckptd_is_a_named_value_with_ckptds_own_default(chart) -> None:
    """ckptd's limits reach it from `ckptd.fairShare` (one value each, checked by the schema),
    not through extraArgs, and the chart's defaults are ckptd's: what ckptd parses from the
    rendered pod is `DataLimits()`; a value set in the chart reaches it."""
    from ckptd.config import DataLimits
    from scaletrain.app.commands.ckptd import _LIMIT_FLAGS, _limits

    def parsed(values: dict[str, Any]) -> DataLimits:
        return _limits(ckptd_parsed(chart, values))

    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["ckptd"]["fairShare"]
    assert len(defaults) == len(_LIMIT_FLAGS)
    assert parsed({}) == DataLimits()
    assert parsed({"ckptd": {"fairShare": {"uploadsPerRun": 64}}}).uploads_per_run == 64
    with pytest.raises(Exception, match="uploadsPerRunn"):
        render_raw(chart, {"ckptd": {"fairShare": {"uploadsPerRunn": 64}}})


def test_ckptds_memory_budget_and_replication_default_to_ckptds_own(chart) -> None:
    """The chart's other ckptd values that ckptd's configuration also defaults (memoryBudgetMb,
    cluster.replicas, cluster.replicaMbS) hold the same defaults, and a value set reaches ckptd."""
    from ckptd.config import CkptdConfig, ClusterConfig

    args = ckptd_parsed(chart, {})
    assert args.memory_budget_mb << 20 == CkptdConfig(data_dir=Path(".")).memory_budget_bytes
    assert args.replicas == ClusterConfig().replicas
    assert args.replica_mb_s * (1 << 20) == ClusterConfig().replica_bytes_s
    changed = {"memoryBudgetMb": 2048, "cluster": {"replicas": 3, "replicaMbS": 64.5}}
    args = ckptd_parsed(chart, {"ckptd": changed})
    assert (args.memory_budget_mb, args.replicas, args.replica_mb_s) == (2048, 3, 64.5)


def test_the_charts_schema_of_the_fair_shares_is_ckptds_flags() -> None:
    """Generated from ckptd's flags, as the trainer's options are: a limit added to ckptd is one
    the chart names, types and describes alike."""
    from scaletrain.app.commands import ckptd

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["properties"]["ckptd"]["properties"]["fairShare"] == ckptd.helm_schema(), (
        "run `python -m scaletrain.app.commands.ckptd` to update the chart's schema"
    )
