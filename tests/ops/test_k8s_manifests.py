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
        bad = _one("StatefulSet", "edgeinfer-backend")
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


def _generated(tmp_path: Path, kind: str = "k8s") -> tuple[dict[str, str], str, Path]:
    """What `edgeinfer ops gen-secrets` writes for a new operator: ({variable: value}, tenant key, directory)."""
    from edgeinfer.ops.gen_secrets import generate

    paths, key = generate(kind, tmp_path)
    env_file = paths[0]
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#"))
    return values, key, tmp_path


def _env(monkeypatch, tmp_path) -> dict[str, str]:
    """The containers' environment: the ConfigMap's variables and the generated Secret's values (the
    kustomization's secretGenerator reads the file gen-secrets writes)."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    gen = {g["name"]: g for g in kust["secretGenerator"]}
    assert gen["edgeinfer-secrets"]["envs"] == ["secrets.env"] and gen["edgeinfer-tenants"]["files"] == ["tenants.toml"]
    secret, _, _ = _generated(tmp_path)
    cm = _one("ConfigMap", "edgeinfer-config")
    env = {k: v for k, v in cm["data"].items() if re.fullmatch(r"[A-Z_]+", k)} | secret
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _gateway_config(tmp_path: Path):
    """The ConfigMap's gateway.toml with the Secret's tenants.toml where the pod mounts it (tenants_file)."""
    from edgeinfer.gateway import config as config_mod

    cm = _one("ConfigMap", "edgeinfer-config")
    text = cm["data"]["gateway.toml"]
    dep = _one("Deployment", "edgeinfer-gateway")
    mounts = {m["name"]: m["mountPath"] for m in dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    wanted = tomllib.loads(text)["server"]["tenants_file"]
    assert wanted == mounts["tenants"] + "/tenants.toml"
    (tmp_path / "gateway.toml").write_text(text.replace(wanted, str(tmp_path / "tenants.toml")))
    return config_mod.load(tmp_path / "gateway.toml")


def test_the_gateway_config_parses_and_reaches_redis(monkeypatch, tmp_path):
    from edgeinfer.gateway import cli as gateway_cli
    from edgeinfer.gateway import config as config_mod

    env = _env(monkeypatch, tmp_path)
    cfg = gateway_cli.with_env(_gateway_config(tmp_path))
    assert cfg.server.redis_url == env["EDGEINFER_REDIS_URL"] and cfg.server.redis_cluster is False
    assert cfg.server.port == 8080 and cfg.tenants and cfg.models
    config_mod.check_secrets(cfg)          # the generated secrets and tenant key pass the gateway's start checks
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


def test_the_backend_statefulset_drains_before_it_stops(monkeypatch, tmp_path):
    from edgeinfer.backend.node_config import parse_args
    from edgeinfer.ops.commands import parser as ops_parser

    env = _env(monkeypatch, tmp_path)
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


def test_compose_wires_valkey_the_gateway_and_two_backends(monkeypatch, tmp_path):
    """compose.yaml: it builds the image (tagged with the version), the gateway's TOML parses with the tenants file
    gen-secrets writes, each backend's command parses with the backend's parser and advertises its own service
    name, the gateway waits for healthy backends; no secret has a fallback value."""
    from edgeinfer.backend.node_config import parse_args
    from edgeinfer.gateway import config as config_mod

    doc = yaml.safe_load((K8S.parents[1] / "compose.yaml").read_text())
    services = doc["services"]
    assert set(services) == {"valkey", "gateway", "backend-0", "backend-1"}
    built = [name for name, svc in services.items() if "build" in svc]
    assert built == ["valkey"] and services["valkey"]["build"]["dockerfile"] == "Dockerfile"
    assert services["valkey"]["build"]["context"] == "." and "VERSION" in services["valkey"]["build"]["args"]
    for svc in services.values():                 # one image, built here, never pulled from a registry
        assert re.fullmatch(r"localhost/edgeinfer:\$\{EDGEINFER_VERSION:-\d+\.\d+\.\d+\}", svc["image"])
        assert svc["pull_policy"] == "never"
    for name in ("gateway", "backend-0", "backend-1"):      # read-only roots, as on Kubernetes
        assert services[name]["read_only"] is True and services[name]["tmpfs"] == ["/tmp"]
    mounts = [v.split(":") for v in services["gateway"]["volumes"]]
    assert mounts[0][1] == "/etc/edgeinfer/gateway.toml" == services["gateway"]["command"][2]
    toml = K8S.parents[1] / mounts[0][0]
    text = tomllib.loads(toml.read_text())
    tenants_at = dict((m[1], m[0]) for m in mounts)["/etc/edgeinfer/" + text["server"]["tenants_file"]]
    assert tenants_at == "./deploy/compose/tenants.toml"
    values, key, root = _generated(tmp_path, "compose")
    (root / "deploy" / "compose" / "gateway.toml").write_text(toml.read_text())
    cfg = config_mod.load(root / "deploy" / "compose" / "gateway.toml")
    assert cfg.server.port == 8080 and cfg.tenants[0].api_key_sha256 == [config_mod.hash_key(key)]
    raw = services["backend-0"]["environment"]
    for name in ("EDGEINFER_INTERNAL_SECRET", "EDGEINFER_PAGE_KEY", "EDGEINFER_CACHE_SEED", "EDGEINFER_OPERATOR_KEY"):
        assert re.fullmatch(rf"\$\{{{name}:\?.+\}}", raw[name]), raw[name]      # no fallback: unset stops compose
    env = {k: values.get(k, v) for k, v in raw.items()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config_mod.check_secrets(cfg)
    for name in ("backend-0", "backend-1"):
        cmd = services[name]["command"]
        assert cmd[0] == "backend"
        c = parse_args(cmd[1:])
        assert c.node_id == name and c.advertise_url == f"http://{name}:8081" and c.log_format == "json"
        assert c.internal_secret == env["EDGEINFER_INTERNAL_SECRET"]
    assert set(services["gateway"]["depends_on"]) == {"backend-0", "backend-1"}
    assert services["gateway"]["ports"] == ["127.0.0.1:8080:8080"]


# ---- Pod Security "restricted" (https://kubernetes.io/docs/concepts/security/pod-security-standards/) -------------

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                   "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What the restricted profile (and our read-only rule) refuses in a pod spec; [] when it passes."""
    out = []
    psc = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(flag)
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {v['name']}: {kinds - ALLOWED_VOLUMES}")
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp!r}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: readOnlyRootFilesystem must be true")
    return out


def _pods() -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in _all()
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")}


def test_every_pod_passes_pod_security_restricted_with_a_read_only_root():
    pods = _pods()
    assert set(pods) == {"edgeinfer-gateway", "edgeinfer-backend", "valkey"}
    for name, pod in pods.items():
        assert restricted_violations(pod) == [], name
    ns = _one("Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    # the checker does refuse what the profile refuses
    bad = _pods()["edgeinfer-backend"]
    bad["containers"][0]["securityContext"].pop("allowPrivilegeEscalation")
    bad["securityContext"].pop("seccompProfile")
    bad["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
    assert len(restricted_violations(bad)) == 3


def test_only_the_gateway_and_the_backends_reach_the_backends_and_valkey():
    policies = {d["metadata"]["name"]: d for d in _all() if d["kind"] == "NetworkPolicy"}
    backend = policies["edgeinfer-backend"]["spec"]
    assert backend["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "edgeinfer-backend"}
    sources = [f.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
               for rule in backend["ingress"] for f in rule["from"]]
    assert sources == ["edgeinfer-gateway", "edgeinfer-backend", "prometheus"]
    valkey = policies["valkey"]["spec"]
    assert [f["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for f in valkey["ingress"][0]["from"]] == \
        ["edgeinfer-gateway", "edgeinfer-backend"]
    port = {p["containerPort"] for p in _one("StatefulSet", "edgeinfer-backend")["spec"]["template"]["spec"][
        "containers"][0]["ports"]}
    assert {p["port"] for r in backend["ingress"] for p in r["ports"]} == port


def test_valkey_is_deployed_with_persistence_and_the_config_points_at_it():
    sts = _one("StatefulSet", "valkey")
    args = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in args and "--dir /data" in args
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    svc = _one("Service", "valkey")
    url = _one("ConfigMap", "edgeinfer-config")["data"]["EDGEINFER_REDIS_URL"]
    assert url.startswith(f"redis://{svc['metadata']['name']}.edgeinfer.svc.cluster.local:"
                          f"{svc['spec']['ports'][0]['port']}/")


def test_no_manifest_holds_a_secret_or_a_placeholder():
    from edgeinfer.protocol.secrets import weak_secret

    assert not any(d["kind"] == "Secret" for d in _all())
    text = "\n".join((K8S / n).read_text() for n in yaml.safe_load((K8S / "kustomization.yaml").read_text())[
        "resources"]) + (K8S.parents[1] / "compose.yaml").read_text()
    assert "REPLACE-with" not in text and "change-me" not in text
    assert weak_secret("REPLACE-with-64-hex-chars") and weak_secret("compose-internal-secret-change-me-0123456789ab")


def test_gen_secrets_writes_strong_values_once(tmp_path, capsys):
    from edgeinfer.ops.commands import run
    from edgeinfer.protocol.secrets import weak_secret

    assert run("ops", ["gen-secrets", "--k8s", str(tmp_path)]) == 0
    key = capsys.readouterr().out.strip()
    values, _, _ = _generated(tmp_path / "again")
    for k, v in values.items():
        assert weak_secret(v) is None, k
    assert (tmp_path / "secrets.env").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "tenants.toml").stat().st_mode & 0o777 == 0o644      # hashes only; read by uid 10001
    assert key.startswith("sk-") and weak_secret(key) is None
    assert run("ops", ["gen-secrets", "--k8s", str(tmp_path)]) == 2     # never overwritten
    assert "exists" in capsys.readouterr().err
