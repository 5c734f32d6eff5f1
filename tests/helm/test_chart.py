"""The scaletrain Helm chart: lints clean, renders valid manifests, and wires the services together.

Offline: the real Helm v4 engine (helm-python-sdk) renders the chart and kubernetes-validate checks
every manifest against the Kubernetes OpenAPI schemas; no cluster is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "scaletrain"
KUBE_VERSION = "1.33.0"
RELEASE = "st"
NAMESPACE = "ml"
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "Job")

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
PG_URL = "postgresql+psycopg://scaletrain:pw@pg.db.svc:5432/scaletrain"

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    # External PostgreSQL and S3 credentials given inline: the chart creates both Secrets.
    "created-secrets": {
        "ckptd": {
            "kind": "Deployment",
            "s3": {
                "endpoint": "http://seaweedfs.storage:8333",
                "bucket": "ckpt",
                "credentials": {"accessKeyId": "AKIA", "secretAccessKey": "s3cr3t"},
            },
        },
        "telemetry": {"replicas": 2, "database": {"url": PG_URL}},
        "trainer": {"gpu": {"enabled": False}, "nprocPerNode": 4},
    },
    # A GPU cluster: existing Secrets, host-path SSD tier, ingress, 4 nodes x 8 GPUs.
    "existing-secrets-at-scale": {
        "trainingNodes": {
            "nodeSelector": {"node.kubernetes.io/instance-type": "h200x8"},
            "tolerations": [GPU_TOLERATION],
        },
        "ckptd": {
            "storage": {"type": "hostPath", "hostPath": "/mnt/nvme/scaletrain"},
            "s3": {
                "endpoint": "https://s3.eu-west-1.amazonaws.com",
                "bucket": "ckpt",
                "region": "eu-west-1",
                "credentials": {
                    "existingSecret": "s3-creds",
                    "accessKeyIdKey": "id",
                    "secretAccessKeyKey": "key",
                    # Ignored: existingSecret wins.
                    "accessKeyId": "AKIA",
                    "secretAccessKey": "s3cr3t",
                },
            },
        },
        "telemetry": {
            "database": {"existingSecret": "pg-url", "existingSecretKey": "url", "url": PG_URL}
        },
        "ui": {
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "hosts": [
                    {"host": "train.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}
                ],
                "tls": [{"secretName": "train-tls", "hosts": ["train.example.com"]}],
            }
        },
        "trainer": {
            "runId": "llama-8b-r1",
            "nodes": 4,
            "nprocPerNode": 8,
            "steps": 1_000_000,
            "ckptEvery": 500,
            "maxRestarts": 5,
            "backoffLimit": 10,
            "resume": True,
            "ompNumThreads": 12,
        },
    },
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render_raw(chart: helm.Chart, values: dict[str, Any], release: str = RELEASE) -> dict[str, str]:
    return chart.render(values, name=release, namespace=NAMESPACE, is_install=True)


def manifests(chart: helm.Chart, values: dict[str, Any], release: str = RELEASE) -> list[dict]:
    docs = []
    for path, text in render_raw(chart, values, release).items():
        if path.endswith(".txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


@cache
def rendered(variant: str) -> list[dict]:
    """The manifests of one of VARIANTS, rendered once per test session."""
    with helm.Chart.load(CHART_DIR) as loaded:
        return manifests(loaded, VARIANTS[variant])


def of_kind(docs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    return [
        d
        for d in docs
        if d["kind"] == kind
        and (
            component is None
            or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        )
    ]


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = of_kind(docs, kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def workload(docs: list[dict], component: str) -> dict:
    found = [
        d
        for d in docs
        if d["kind"] in WORKLOAD_KINDS
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, f"expected one workload for {component}, got {len(found)}"
    return found[0]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def container(doc: dict) -> dict:
    (only,) = pod_spec(doc)["containers"]
    return only


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} must appear once in {argv}"
    return argv[argv.index(name) + 1]


def secret_ref(c: dict, variable: str) -> tuple[str, str]:
    ref = env_of(c)[variable]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


# --- lint and schema validity ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_chart_passes_strict_helm_lint(variant: str) -> None:
    report = helm.lint(CHART_DIR, VARIANTS[variant], strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == []
    assert problems == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_manifest_is_valid_kubernetes(variant: str) -> None:
    docs = rendered(variant)
    assert {"Job", "Service", "ServiceAccount"} <= {d["kind"] for d in docs}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_long_release_names_keep_object_and_trainer_host_names_within_dns_limits(chart) -> None:
    long_release = "a-very-long-release-name-for-a-large-pretraining-run-2026"
    docs = manifests(chart, {"trainer": {"nodes": 16}}, release=long_release)
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63
    job = one(docs, "Job", "trainer")
    assert len(f"{job['metadata']['name']}-15") <= 63


# --- trainer --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("variant", "nodes"), [("defaults", 1), ("existing-secrets-at-scale", 4)])
def test_trainer_job_is_indexed_with_one_pod_per_node(variant: str, nodes: int) -> None:
    job = one(rendered(variant), "Job", "trainer")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == nodes
    assert pod_spec(job)["restartPolicy"] == "Never"


def test_trainer_pods_rendezvous_at_pod_zero_through_the_headless_service() -> None:
    docs = rendered("existing-secrets-at-scale")
    job = one(docs, "Job", "trainer")
    service = one(docs, "Service", "trainer")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"][0]["port"] == 29400
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pod_spec(job)["subdomain"] == service["metadata"]["name"]

    argv = container(job)["args"]
    job_name, svc_name = job["metadata"]["name"], service["metadata"]["name"]
    pod_zero = f"{job_name}-0.{svc_name}.{NAMESPACE}.svc.cluster.local"
    assert flag(argv, "--rdzv-endpoint") == f"{pod_zero}:29400"
    assert flag(argv, "--rdzv-backend") == "c10d"


def test_torchrun_command_has_the_configured_flags() -> None:
    docs = rendered("existing-secrets-at-scale")
    trainer = container(one(docs, "Job", "trainer"))
    assert trainer["command"] == ["torchrun"]
    argv = trainer["args"]
    module_at = argv.index("-m")
    torchrun_args, (module, *trainer_args) = argv[:module_at], argv[module_at + 1 :]
    assert module == "trainer"

    assert flag(torchrun_args, "--nnodes") == "4"
    assert flag(torchrun_args, "--nproc-per-node") == "8"
    assert flag(torchrun_args, "--rdzv-id") == "llama-8b-r1"
    assert flag(torchrun_args, "--max-restarts") == "5"

    ckptd_service = one(docs, "Service", "ckptd")["metadata"]["name"]
    telemetry_service = one(docs, "Service", "telemetry")["metadata"]["name"]
    assert flag(trainer_args, "--run-id") == "llama-8b-r1"
    assert flag(trainer_args, "--ckptd") == f"{ckptd_service}:50051"
    assert flag(trainer_args, "--telemetry") == f"{telemetry_service}:50052"
    assert flag(trainer_args, "--steps") == "1000000"
    assert flag(trainer_args, "--ckpt-every") == "500"
    assert "--resume" in trainer_args

    assert env_of(trainer)["OMP_NUM_THREADS"]["value"] == "12"
    assert one(docs, "Job", "trainer")["spec"]["backoffLimit"] == 10


def test_trainer_run_id_defaults_to_the_release_name_and_does_not_resume() -> None:
    argv = container(one(rendered("defaults"), "Job", "trainer"))["args"]
    assert flag(argv, "--rdzv-id") == flag(argv, "--run-id") == RELEASE
    assert "--resume" not in argv


@pytest.mark.parametrize(
    ("variant", "gpus"), [("existing-secrets-at-scale", 8), ("created-secrets", 0)]
)
def test_trainer_requests_one_gpu_per_process(variant: str, gpus: int) -> None:
    resources = container(one(rendered(variant), "Job", "trainer"))["resources"]
    for section in ("requests", "limits"):
        assert resources[section].get("nvidia.com/gpu", 0) == gpus


def test_trainer_runs_on_the_training_nodes_beside_a_ckptd() -> None:
    docs = rendered("existing-secrets-at-scale")
    trainer, ckptd = pod_spec(one(docs, "Job", "trainer")), pod_spec(workload(docs, "ckptd"))
    expected = VARIANTS["existing-secrets-at-scale"]["trainingNodes"]
    for spec in (trainer, ckptd):
        assert spec["nodeSelector"] == expected["nodeSelector"]
        assert spec["tolerations"] == expected["tolerations"]


# --- security and resources -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_runs_as_non_root_without_capabilities_and_with_resources(
    variant: str,
) -> None:
    workloads = [d for d in rendered(variant) if d["kind"] in WORKLOAD_KINDS]
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in workloads} == {
        "ckptd",
        "telemetry",
        "ui",
        "trainer",
    }
    for w in workloads:
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        tmp_volumes = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{w['kind']}/{w['metadata']['name']}/{c['name']}"
            sc = c["securityContext"]
            assert sc.get("runAsNonRoot", True) is True, where
            assert sc.get("runAsUser", 1) != 0, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where
            for section in ("requests", "limits"):
                assert {"cpu", "memory"} <= c["resources"][section].keys(), where
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1, where
            assert tmp[0]["name"] in tmp_volumes, where


# --- services and probes --------------------------------------------------------------------------


@pytest.mark.parametrize(("component", "port"), [("ckptd", 50051), ("telemetry", 50052)])
def test_grpc_services_have_native_grpc_health_probes(component: str, port: int) -> None:
    docs = rendered("defaults")
    c = container(workload(docs, component))
    assert c["command"] == ["scaletrain", component]
    assert flag(c["args"], "--listen") == f"0.0.0.0:{port}"
    assert "--allow-plaintext" in c["args"]  # plaintext off loopback is refused unless allowed
    assert c["ports"] == [{"name": "grpc", "containerPort": port, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": port}, probe
    service_port = one(docs, "Service", component)["spec"]["ports"][0]
    assert (service_port["port"], service_port["targetPort"]) == (port, "grpc")


def test_ui_is_probed_on_the_streamlit_health_endpoint() -> None:
    docs = rendered("defaults")
    ui = container(workload(docs, "ui"))
    assert ui["command"] == ["scaletrain", "ui"]
    assert flag(ui["args"], "--host") == "0.0.0.0"
    assert flag(ui["args"], "--port") == "8501"
    for probe in ("livenessProbe", "readinessProbe"):
        assert ui[probe]["httpGet"] == {"path": "/_stcore/health", "port": "http"}, probe
    assert one(docs, "Service", "ui")["spec"]["ports"][0]["port"] == 8501


def test_ckptd_is_a_daemonset_whose_service_keeps_traffic_on_the_node() -> None:
    docs = rendered("existing-secrets-at-scale")
    ckptd = workload(docs, "ckptd")
    assert ckptd["kind"] == "DaemonSet"
    assert one(docs, "Service", "ckptd")["spec"]["internalTrafficPolicy"] == "Local"
    c = container(ckptd)
    assert flag(c["args"], "--data-dir") == "/var/lib/scaletrain/ckptd"
    assert flag(c["args"], "--memory-budget-mb") == "1024"
    assert flag(c["args"], "--s3-endpoint") == "https://s3.eu-west-1.amazonaws.com"
    assert flag(c["args"], "--s3-bucket") == "ckpt"
    assert flag(c["args"], "--s3-region") == "eu-west-1"
    telemetry_service = one(docs, "Service", "telemetry")["metadata"]["name"]
    assert flag(c["args"], "--telemetry") == f"{telemetry_service}:50052"
    (data_mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/var/lib/scaletrain/ckptd"]
    (data,) = [v for v in pod_spec(ckptd)["volumes"] if v["name"] == data_mount["name"]]
    assert data["hostPath"]["path"] == "/mnt/nvme/scaletrain"


def test_ckptd_as_a_deployment_is_one_replica_behind_a_cluster_wide_service() -> None:
    docs = rendered("created-secrets")
    ckptd = workload(docs, "ckptd")
    assert ckptd["kind"] == "Deployment"
    assert ckptd["spec"]["replicas"] == 1
    assert "internalTrafficPolicy" not in one(docs, "Service", "ckptd")["spec"]
    assert "emptyDir" in next(v for v in pod_spec(ckptd)["volumes"] if v["name"] == "data")
    args = container(ckptd)["args"]
    assert flag(args, "--s3-endpoint") == "http://seaweedfs.storage:8333"
    assert "--s3-region" not in args


def test_ckptd_has_no_s3_tier_and_no_credentials_by_default() -> None:
    c = container(workload(rendered("defaults"), "ckptd"))
    assert not any(a.startswith("--s3-") for a in c["args"])
    assert "AWS_ACCESS_KEY_ID" not in env_of(c)


# --- databases and secrets ------------------------------------------------------------------------


def test_telemetry_keeps_sqlite_on_a_claim_the_ui_shares_by_default() -> None:
    docs = rendered("defaults")
    assert of_kind(docs, "Secret") == []
    claim = one(docs, "PersistentVolumeClaim", "telemetry")["metadata"]["name"]
    telemetry, ui = workload(docs, "telemetry"), workload(docs, "ui")
    assert telemetry["spec"]["strategy"]["type"] == "Recreate"
    assert telemetry["spec"]["replicas"] == 1
    for w in (telemetry, ui):
        c = container(w)
        assert flag(c["args"], "--db") == "sqlite:////var/lib/scaletrain/telemetry/telemetry.db"
        assert "SCALETRAIN_DB_URL" not in env_of(c)
        volumes = pod_spec(w)["volumes"]
        claims = [
            v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
        ]
        assert claims == [claim]
    (term,) = pod_spec(ui)["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= (
        telemetry["spec"]["template"]["metadata"]["labels"].items()
    )


def test_inline_credentials_and_database_url_are_rendered_into_secrets() -> None:
    docs = rendered("created-secrets")
    secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    assert len(secrets) == 2
    assert of_kind(docs, "PersistentVolumeClaim") == []

    ckptd = container(workload(docs, "ckptd"))
    s3_secret, key_id = secret_ref(ckptd, "AWS_ACCESS_KEY_ID")
    assert secrets[s3_secret]["stringData"][key_id] == "AKIA"
    s3_secret, secret_key = secret_ref(ckptd, "AWS_SECRET_ACCESS_KEY")
    assert secrets[s3_secret]["stringData"][secret_key] == "s3cr3t"

    for component in ("telemetry", "ui"):
        c = container(workload(docs, component))
        assert "--db" not in c["args"], component
        db_secret, db_key = secret_ref(c, "SCALETRAIN_DB_URL")
        assert secrets[db_secret]["stringData"][db_key] == PG_URL
    assert workload(docs, "telemetry")["spec"]["replicas"] == 2


def test_no_secret_is_rendered_when_existing_secrets_are_given() -> None:
    docs = rendered("existing-secrets-at-scale")
    assert of_kind(docs, "Secret") == []
    assert of_kind(docs, "PersistentVolumeClaim") == []
    ckptd = container(workload(docs, "ckptd"))
    assert secret_ref(ckptd, "AWS_ACCESS_KEY_ID") == ("s3-creds", "id")
    assert secret_ref(ckptd, "AWS_SECRET_ACCESS_KEY") == ("s3-creds", "key")
    for component in ("telemetry", "ui"):
        c = container(workload(docs, component))
        assert secret_ref(c, "SCALETRAIN_DB_URL") == ("pg-url", "url"), component
        assert "--db" not in c["args"], component


def test_ingress_routes_the_configured_host_to_the_ui_service() -> None:
    docs = rendered("existing-secrets-at-scale")
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
    assert of_kind(rendered("defaults"), "Ingress") == []


def test_disabled_components_render_nothing(chart) -> None:
    docs = manifests(chart, {"trainer": {"enabled": False}, "ui": {"enabled": False}})
    components = {d["metadata"]["labels"].get("app.kubernetes.io/component") for d in docs}
    assert components == {None, "ckptd", "telemetry"}


def test_notes_say_how_to_reach_the_ui_and_follow_the_trainer(chart) -> None:
    notes = render_raw(chart, {})["scaletrain/templates/NOTES.txt"]
    assert f"port-forward svc/{RELEASE}-scaletrain-ui 8501" in notes
    assert f"logs -f job/{RELEASE}-scaletrain-trainer" in notes


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ({"trainer": {"nodes": 0}}, helm.HelmValuesError, "at '/trainer/nodes': minimum"),
        ({"trainer": {"nodes": "two"}}, helm.HelmValuesError, "at '/trainer/nodes'"),
        ({"trainer": {"nprocPerNode": 0}}, helm.HelmValuesError, "/trainer/nprocPerNode"),
        ({"trainer": {"node": 2}}, helm.HelmValuesError, "'node' not allowed"),
        ({"ckptd": {"kind": "StatefulSet"}}, helm.HelmValuesError, "/ckptd/kind"),
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
            {"telemetry": {"replicas": 2}},
            helm.HelmRenderError,
            "telemetry.replicas > 1 needs an external database",
        ),
        (
            {"ckptd": {"enabled": False}},
            helm.HelmRenderError,
            "trainer.enabled needs ckptd.enabled or trainer.ckptdAddress",
        ),
    ],
    ids=[
        "zero-nodes",
        "nodes-not-a-number",
        "zero-processes",
        "misspelt-key",
        "unknown-ckptd-kind",
        "half-s3-credentials",
        "s3-credentials-without-endpoint",
        "replicated-sqlite",
        "trainer-without-ckptd",
    ],
)
def test_bad_values_fail_rendering_with_a_clear_message(
    chart, values: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        render_raw(chart, values)
