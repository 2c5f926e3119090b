"""deploy/k8s validated offline: every resource against the Kubernetes schema of kubernetes-validate's newest release
(strict: no unknown fields), the ServiceMonitor (a CRD the schema does not hold) by its own required fields, and what
the manifests say to edgeinfer checked by edgeinfer itself: the gateway's TOML parses with the gateway's config
loader, the backend's arguments and the ConfigMap's EDGEINFER_ARG_* variables parse with the backend's parser, the
preStop hook is a drain the `edgeinfer ops` parser takes, and the grace period covers its deadline."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _docs() -> dict[str, list[dict]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return {name: [d for d in yaml.safe_load_all((K8S / name).read_text()) if d] for name in kust["resources"]}


def _all() -> list[dict]:
    return [d for docs in _docs().values() for d in docs]


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for d in _all() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def test_the_kustomization_lists_every_manifest_and_nothing_else():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization" and kust["namespace"] == "edgeinfer"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk


def test_every_resource_validates_against_the_kubernetes_schema():
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    checked = 0
    for d in _all():
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(d, version, strict=True)
        checked += 1
    assert checked >= 9
    with pytest.raises(kubernetes_validate.ValidationError):    # the validator does refuse what is wrong
        bad = _one("StatefulSet")
        bad["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["comand"] = ["x"]
        kubernetes_validate.validate(bad, version, strict=True)


def test_the_service_monitor_scrapes_named_ports_of_our_services():
    sm = _one("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    ep = sm["spec"]["endpoints"]
    assert ep and all(e["path"] == "/metrics" for e in ep)
    wanted = set(sm["spec"]["selector"]["matchExpressions"][0]["values"])
    services = [d for d in _all() if d["kind"] == "Service"]
    covered = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in services
               if any(p["name"] == e["port"] for p in s["spec"]["ports"] for e in ep)}
    assert wanted == covered == {"gateway", "backend"}


def _env(monkeypatch) -> dict[str, str]:
    """The containers' environment: the ConfigMap's variables and the Secret's values."""
    cm, secret = _one("ConfigMap", "edgeinfer-config"), _one("Secret", "edgeinfer-secrets")
    env = {k: v for k, v in cm["data"].items() if re.fullmatch(r"[A-Z_]+", k)} | secret["stringData"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def test_the_gateway_config_parses_and_reaches_redis(monkeypatch):
    from edgeinfer.gateway import cli as gateway_cli
    from edgeinfer.gateway import config as config_mod

    env = _env(monkeypatch)
    cm = _one("ConfigMap", "edgeinfer-config")
    cfg = gateway_cli.with_env(config_mod.parse(tomllib.loads(cm["data"]["gateway.toml"]), "gateway.toml"))
    assert cfg.server.redis_url == env["EDGEINFER_REDIS_URL"] and cfg.server.redis_cluster is False
    assert cfg.server.port == 8080 and cfg.tenants and cfg.models
    dep = _one("Deployment", "edgeinfer-gateway")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:3] == ["gateway", "--config", "/etc/edgeinfer/gateway.toml"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > cfg.server.shutdown_grace_s
    monkeypatch.setenv("EDGEINFER_REDIS_CLUSTER", "1")
    assert gateway_cli.with_env(cfg).server.redis_cluster is True
    monkeypatch.setenv("EDGEINFER_REDIS_CLUSTER", "maybe")
    with pytest.raises(config_mod.ConfigError, match="EDGEINFER_REDIS_CLUSTER"):
        gateway_cli.with_env(cfg)


def test_the_backend_statefulset_drains_before_it_stops(monkeypatch):
    from edgeinfer.backend.node_config import parse_args
    from edgeinfer.ops.commands import parser as ops_parser

    env = _env(monkeypatch)
    sts = _one("StatefulSet", "edgeinfer-backend")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = [a.replace("$(POD_NAME)", "edgeinfer-backend-0").replace("$(POD_NAMESPACE)", "edgeinfer")
            for a in c["args"][1:]]
    cfg = parse_args(args)             # every flag is the backend's, and the ConfigMap's EDGEINFER_ARG_* parse
    assert cfg.node_id == "edgeinfer-backend-0" and cfg.log_format == "json" and cfg.redis_cluster is False
    headless = _one("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert cfg.advertise_url == f"http://edgeinfer-backend-0.{headless['metadata']['name']}.edgeinfer.svc.cluster.local:8081"
    assert cfg.internal_secret == env["EDGEINFER_INTERNAL_SECRET"] and cfg.operator_key == env["EDGEINFER_OPERATOR_KEY"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"     # 503 while draining: out of the Service at once
    stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[:3] == ["edgeinfer", "ops", "drain"]
    drain = ops_parser().parse_args(stop[2:])                         # `edgeinfer ops drain ...` as the CLI reads it
    assert drain.node == "http://127.0.0.1:8081" and drain.operator_key == env["EDGEINFER_OPERATOR_KEY"]
    assert pod["terminationGracePeriodSeconds"] >= drain.deadline + 30   # the drain, then the backend's own 30 s
    refs = {r["secretRef"]["name"] for r in c["envFrom"] if "secretRef" in r}
    assert refs == {"edgeinfer-secrets"}


def test_the_autoscalers_target_what_exists():
    for hpa in (d for d in _all() if d["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        _one(ref["kind"], ref["name"])
    backend = _one("HorizontalPodAutoscaler", "edgeinfer-backend")
    metric = backend["spec"]["metrics"][0]["external"]["metric"]
    from edgeinfer.gateway.metrics import Metrics

    assert metric["name"] in Metrics().render(False).decode() or metric["name"] == "edgeinfer_gateway_pool_load_ratio"
    assert set(metric["selector"]["matchLabels"]) == {"model", "role"}


def test_compose_wires_valkey_the_gateway_and_two_backends(monkeypatch):
    """compose.yaml: the gateway's TOML parses, each backend's command parses with the backend's parser and
    advertises its own service name, the gateway waits for healthy backends."""
    from edgeinfer.backend.node_config import parse_args
    from edgeinfer.gateway import config as config_mod

    doc = yaml.safe_load((K8S.parents[1] / "compose.yaml").read_text())
    services = doc["services"]
    assert set(services) == {"valkey", "gateway", "backend-0", "backend-1"}
    mount = services["gateway"]["volumes"][0].split(":")
    assert mount[1] == "/etc/edgeinfer/gateway.toml" == services["gateway"]["command"][2]
    toml = K8S.parents[1] / mount[0]
    cfg = config_mod.parse(tomllib.loads(toml.read_text()), str(toml))
    assert cfg.server.port == 8080 and cfg.tenants
    env = {k: re.sub(r"\$\{[A-Z_]+:-(.*)\}", r"\1", v) for k, v in services["backend-0"]["environment"].items()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for name in ("backend-0", "backend-1"):
        cmd = services[name]["command"]
        assert cmd[0] == "backend"
        c = parse_args(cmd[1:])
        assert c.node_id == name and c.advertise_url == f"http://{name}:8081" and c.log_format == "json"
        assert c.internal_secret == env["EDGEINFER_INTERNAL_SECRET"]
    assert set(services["gateway"]["depends_on"]) == {"backend-0", "backend-1"}
    assert services["gateway"]["ports"] == ["127.0.0.1:8080:8080"]
