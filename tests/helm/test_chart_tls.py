"""The chart with TLS (values `tls`): each gRPC component (ckptd, telemetry, and the trainer as
their client) mounts its certificate, from an existing Secret or a cert-manager `Certificate`
the chart renders, as the files scaletrain reads, and probes its health over TLS with a command
that really works against a TLS server. Rendered by the real Helm engine, as test_chart.py does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from test_chart import (
    CHART_DIR,
    KUBE_VERSIONS,
    NAME,
    NAMESPACE,
    container,
    env_of,
    of_kind,
    parse,
    pod_spec,
    pod_templates,
    render_raw,
    trainer,
    workload,
)

from scaletrain.security import (
    TLS_CLIENT_AUTH_ENV,
    TLS_DIR_ENV,
    ServerSecurity,
    TlsFiles,
    generate_certs,
)
from scaletrain.transport import add_health, bind, make_server

ISSUER = {"name": "scaletrain-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
# ckptd as one Deployment: TLS with the DaemonSet's peers found by pod IP is refused (below).
ONE_CKPTD = {"ckptd": {"kind": "Deployment"}}
CERT_MANAGER = {"tls": {"enabled": True, "certManager": {"issuerRef": ISSUER}}, **ONE_CKPTD}
SECRETS = {"ckptd": "ckptd-cert", "telemetry": "telemetry-cert", "trainer": "trainer-cert"}
OWN_SECRETS = {"tls": {"enabled": True, "clientAuth": True, "secretNames": SECRETS}, **ONE_CKPTD}
MOUNT = "/etc/scaletrain/tls"
PORTS = {"ckptd": 50051, "telemetry": 50052}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def pods(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """(pod spec, container) of each component with TLS."""
    launcher = trainer(docs)
    return {
        "ckptd": (pod_spec(workload(docs, "ckptd")), container(workload(docs, "ckptd"))),
        "telemetry": (
            pod_spec(workload(docs, "telemetry")),
            container(workload(docs, "telemetry")),
        ),
        "trainer": (pod_spec(launcher), container(launcher)),
    }


def mounted_files(volume: dict) -> dict[str, str]:
    """File name -> Secret key of a secret volume."""
    return {item["path"]: item["key"] for item in volume["secret"]["items"]}


def tls_volume(spec: dict, c: dict) -> dict:
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == MOUNT]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume


@pytest.mark.parametrize("values", [CERT_MANAGER, OWN_SECRETS], ids=["cert-manager", "secrets"])
def test_each_grpc_component_mounts_its_certificate_as_the_files_scaletrain_reads(
    chart: helm.Chart, values: dict[str, Any]
) -> None:
    docs = parse(render_raw(chart, values))
    files = TlsFiles(Path(MOUNT))
    expected = {
        files.ca.name: "ca.crt",
        files.server_cert.name: "tls.crt",
        files.server_key.name: "tls.key",
        files.client_cert.name: "tls.crt",
        files.client_key.name: "tls.key",
    }
    own = values["tls"].get("secretNames", {})
    for component, (spec, c) in pods(docs).items():
        volume = tls_volume(spec, c)
        assert mounted_files(volume) == expected, component
        assert volume["secret"]["secretName"] == own.get(component, f"{NAME}-{component}-tls")
        env = env_of(c)
        assert env[TLS_DIR_ENV]["value"] == str(files.root), component
        client_auth = env.get(TLS_CLIENT_AUTH_ENV, {}).get("value")
        assert client_auth == ("1" if values["tls"].get("clientAuth") else None), component
        assert "--allow-plaintext" not in c.get("args", []), component
    # A renewed certificate reaches the pods in place: no pod carries a checksum of it (which
    # would restart every pod at each renewal).
    for doc in (workload(docs, "ckptd"), workload(docs, "telemetry"), trainer(docs)):
        for template in pod_templates(doc):
            annotations = template["metadata"].get("annotations", {})
            assert [a for a in annotations if "tls" in a or "cert" in a] == []
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job", "Service"):
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("values", [CERT_MANAGER, OWN_SECRETS], ids=["cert-manager", "secrets"])
def test_chart_with_tls_passes_strict_helm_lint(values: dict[str, Any]) -> None:
    report = helm.lint(CHART_DIR, values, strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_cert_manager_issues_a_certificate_naming_each_service_and_localhost(
    chart: helm.Chart,
) -> None:
    docs = parse(render_raw(chart, CERT_MANAGER))
    certificates = {
        c["metadata"]["labels"]["app.kubernetes.io/component"]: c
        for c in of_kind(docs, "Certificate")
    }
    assert sorted(certificates) == ["ckptd", "telemetry", "trainer"]
    for component, certificate in certificates.items():
        assert certificate["apiVersion"] == "cert-manager.io/v1"
        spec = certificate["spec"]
        assert spec["secretName"] == f"{NAME}-{component}-tls"
        assert spec["issuerRef"] == ISSUER
        assert {"server auth", "client auth"} <= set(spec["usages"])
    for component in PORTS:
        spec = certificates[component]["spec"]
        service = f"{NAME}-{component}"
        assert {service, f"{service}.{NAMESPACE}.svc.cluster.local", "localhost"} <= set(
            spec["dnsNames"]
        )
        assert "127.0.0.1" in spec["ipAddresses"]
    assert of_kind(parse(render_raw(chart, OWN_SECRETS)), "Certificate") == []


def test_static_peers_are_named_in_ckptds_certificate(chart: helm.Chart) -> None:
    values = {
        "tls": CERT_MANAGER["tls"],
        "ckptd": {
            "cluster": {"peers": ["ckpt-0.example.com:50051", "10.0.3.7:50051", "[fd00::7]:50051"]}
        },
    }
    docs = parse(render_raw(chart, values))
    (certificate,) = [
        c for c in of_kind(docs, "Certificate") if c["metadata"]["name"] == f"{NAME}-ckptd-tls"
    ]
    assert "ckpt-0.example.com" in certificate["spec"]["dnsNames"]
    assert {"10.0.3.7", "fd00::7"} <= set(certificate["spec"]["ipAddresses"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"enabled": True}, **ONE_CKPTD}, "ckptd has no certificate"),
        (
            {"tls": {"enabled": True, "secretNames": {"ckptd": "c", "trainer": "t"}}, **ONE_CKPTD},
            "telemetry has no certificate",
        ),
        (CERT_MANAGER | {"ckptd": {}}, "dialed by pod IP"),
    ],
    ids=["no-issuer-nor-secret", "one-component-without", "peers-by-pod-ip"],
)
def test_tls_without_a_usable_certificate_is_refused_naming_the_values(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_raw(chart, values)


def test_the_tls_probe_checks_health_over_tls_with_the_pods_own_files(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """The rendered exec probe, run as the kubelet would with the pod's environment and its files
    laid out from a Secret as the volume's items say, passes against a TLS server and fails once
    the server is gone."""
    docs = parse(render_raw(chart, CERT_MANAGER))
    spec, c = pods(docs)["ckptd"]
    certs = generate_certs(tmp_path / "issued")
    secret = {"ca.crt": certs.ca, "tls.crt": certs.server_cert, "tls.key": certs.server_key}
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for name, key in mounted_files(tls_volume(spec, c)).items():
        (mounted / name).write_bytes(secret[key].read_bytes())
    server = make_server(security=ServerSecurity(tls=TlsFiles(mounted)))
    add_health(server)
    port = bind(server, "127.0.0.1:0")
    server.start()

    def probe(kind: str) -> subprocess.CompletedProcess[str]:
        command = c[kind]["exec"]["command"]
        assert command[:3] == ["python", "-m", "scaletrain.transport"]
        assert command[3] == f"localhost:{PORTS['ckptd']}"
        env = {**os.environ, **{e["name"]: e["value"] for e in c["env"] if "value" in e}}
        env[TLS_DIR_ENV] = str(mounted)
        argv = [sys.executable, *command[1:3], f"localhost:{port}"]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    try:
        for kind in PROBES:
            assert c[kind]["timeoutSeconds"] >= 5
        done = probe("readinessProbe")
        assert done.returncode == 0, done.stderr
    finally:
        server.stop(None)
    done = probe("livenessProbe")
    assert done.returncode == 1
    assert "did not become healthy" in done.stderr
