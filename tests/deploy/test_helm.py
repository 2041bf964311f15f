"""The Helm chart (deploy/helm/epd): strict lint, offline render for default and non-default values,
every manifest valid against a recent Kubernetes API in strict mode, the values schema rejecting bad
values, and the rendered process configs accepted by EPD's own config code.

Rendering and lint run offline through helm-python-sdk (Helm's Go SDK over a C ABI, no helm binary
and no cluster); manifests are checked with kubernetes-validate's bundled JSON schemas.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate as kv
import pytest
import torch
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "epd"
KUBE_VERSION = kv.latest_version()  # the newest API the installed kubernetes-validate knows
RELEASE, NAMESPACE = "epd", "serving"
TIERS = ("encoder", "prefill", "decode")


def _file_values(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / "helm" / name).read_text())


CASES: dict[str, dict] = {
    "default": {},
    "gpu": _file_values("values-gpu.yaml"),
    "cpu": _file_values("values-cpu.yaml"),
    "servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    # static discovery: the router is started with every slot an autoscaler may fill
    "hpa": {tier: {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                                   "targetMemoryUtilizationPercentage": 75}, **({"discovery": "static"}
                                                                            if tier == "router" else {})}
            for tier in ("router", *TIERS)},
    "keda": {tier: {"keda": {"enabled": True, "maxReplicas": 6}} for tier in ("router", *TIERS)},
    "pvc": {"model": {"source": "pvc", "path": "/models/qwen2-vl-2b", "pvc": {"claimName": "models",
                                                                             "subPath": "Qwen2-VL-2B"}}},
    "hostpath": {"model": {"source": "hostPath", "path": "/models/qwen2-vl-2b",
                           "hostPath": {"path": "/data/Qwen2-VL-2B"}}},
    "hub": {"model": {"source": "hub", "path": "/models/qwen2-vl-7b", "hub": {"repo": "Qwen/Qwen2-VL-7B-Instruct"},
                      "download": {"secretName": "hf-token"}},
            "priorityClassName": "serving", "decode": {"priorityClassName": "serving-critical"}},
    "s3": {"model": {"source": "s3", "path": "/models/qwen2-vl-7b",
                     "s3": {"url": "s3://models/Qwen2-VL-7B-Instruct", "endpointUrl": "https://minio.example:9000"},
                     "download": {"secretName": "s3-creds"}}},
    "scaled": {"encoder": {"replicas": 3, "affinity": {"podAntiAffinity": {
                   "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
                       "topologyKey": "kubernetes.io/hostname",
                       "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "encoder"}}}}]}}},
               "prefill": {"replicas": 2}, "decode": {"replicas": 2},
               "router": {"replicas": 2, "service": {"type": "NodePort", "nodePorts": {"http": 30800}},
                          "config": {"max_concurrent_requests": 8, "queue_timeout_s": 2.5,
                                     "served_model_name": ["qwen-vl", "qwen"]}},
               "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "dedicated", "operator": "Exists"}]},
    "secured": {"tls": {"enabled": True, "secretName": "epd-tls", "serverName": "epd.serving.internal"},
                "apiKeys": {"secretName": "epd-api-keys", "key": "keys"},
                "networkPolicy": {"enabled": True, "routerFrom": [{"namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}]},
                "router": {"service": {"type": "LoadBalancer"}},
                "encoderCacheStore": {"enabled": True}},
    "exposed": {"runtimeClassName": "nvidia",
                "router": {"ingress": {"enabled": True, "className": "nginx",
                                       "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
                                       "hosts": [{"host": "epd.example.com", "paths": [{"path": "/v1"}]}],
                                       "tls": [{"secretName": "epd-example-tls", "hosts": ["epd.example.com"]}]},
                           "runtimeClassName": "runc",
                           "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                          "whenUnsatisfiable": "ScheduleAnyway"}]},
                "decode": {"topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"},
                    {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone",
                     "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": {"pool": "decode"}}}]}},
    "nccl": {"gpu": {"enabled": True}, "transport": "nccl", "decode": {"gpus": 2},
             "prefill": {"config": {"engine": {"tensor_parallel_size": 2}}},  # one pod, both ranks' GPUs
             "encoderCacheStore": {"enabled": True, "master": "mooncake-master.stores.svc:50061"},
             "encoder": {"config": {"encoder": {"device": "cuda:0", "cuda_graph_buckets": [[4096, 4]]}}}},
}


def render(values: dict | None = None, release: str = RELEASE) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values=values, name=release, namespace=NAMESPACE, is_install=True)


def manifests(rendered: dict[str, str]) -> list[dict]:
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: manifests(render(values)) for name, values in CASES.items()}


# ---------------------------------------------------------------------------- lint and validation

@pytest.mark.parametrize("case", sorted(CASES))
def test_chart_lints_strictly(case):
    report = helm.lint(CHART, CASES[case], strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["total_charts_linted"] == 1
    assert not problems and not report["errors"], json.dumps(report, indent=1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_validates_strictly(case, rendered):
    docs = rendered[case]
    assert docs
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "ScaledObject"):  # CRDs: no schema bundled; checked in their own tests
            continue
        try:
            kv.validate(doc, KUBE_VERSION, strict=True)
        except kv.ValidationError as err:
            pytest.fail(f"{case}: {doc['kind']}/{doc['metadata']['name']} at {list(err.path)}: {err.message}")
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
        assert doc["metadata"].get("namespace", NAMESPACE) == NAMESPACE


def test_default_render_has_every_object(rendered):
    docs = rendered["default"]
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ConfigMap", "Deployment", "Pod", "PodDisruptionBudget", "Service", "ServiceAccount",
                     "StatefulSet"]
    assert set(by_kind(docs, "StatefulSet")) == {f"epd-{t}" for t in TIERS}
    assert set(by_kind(docs, "Deployment")) == {"epd-router"}
    assert set(by_kind(docs, "Service")) == {"epd-router", *(f"epd-{t}-headless" for t in TIERS)}
    assert set(by_kind(docs, "PodDisruptionBudget")) == {f"epd-{t}" for t in ("router", *TIERS)}
    assert not by_kind(docs, "HorizontalPodAutoscaler") and not by_kind(docs, "ServiceMonitor")
    for pdb in by_kind(docs, "PodDisruptionBudget").values():  # one pod per tier must still drain
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}


def test_long_release_name_keeps_names_within_limits():
    docs = manifests(render({}, release="a" * 53))
    for sts in by_kind(docs, "StatefulSet").values():
        # the pods' controller-revision-hash label is "<statefulset>-<10 chars>"
        assert len(sts["metadata"]["name"]) <= 52
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63
        kv.validate(doc, KUBE_VERSION, strict=True)


# ---------------------------------------------------------------------------- schema rejections

BAD_VALUES = {
    "negative replicas": {"encoder": {"replicas": -1}},
    "zero replicas": {"decode": {"replicas": 0}},
    "unknown transport": {"transport": "carrier-pigeon"},
    "missing model": {"model": None},
    "missing model source": {"model": {"source": None}},
    "unknown model source": {"model": {"source": "ftp"}},
    "hub without a repo": {"model": {"source": "hub", "path": "/models/m", "hub": {"repo": ""}}},
    "s3 without an s3 url": {"model": {"source": "s3", "path": "/models/m", "s3": {"url": "https://x/y"}}},
    "unknown preset": {"model": {"preset": "gpt-5"}},
    "pvc without claim": {"model": {"source": "pvc"}},
    "hostPath without path": {"model": {"source": "hostPath"}},
    "relative model path": {"model": {"source": "hostPath", "path": "models", "hostPath": {"path": "/data"}}},
    "typo in engine config": {"prefill": {"config": {"engine": {"kv_cache_byte": 1}}}},
    "zero tensor-parallel ranks": {"decode": {"config": {"engine": {"tensor_parallel_size": 0}}}},
    "chart-managed worker field": {"decode": {"config": {"port": 1234}}},
    "bad dtype": {"gpu": {"dtype": "float8"}},
    "unknown routing policy": {"router": {"config": {"encoder_policy": "random"}}},
    "negative queue": {"router": {"config": {"max_queued_requests": -1}}},
    "bad port": {"workerPorts": {"grpc": 70000}},
    "unknown top-level key": {"replicas": 3},
    "non-numeric gpus": {"gpu": {"count": "one"}},
    "bad hpa bounds": {"encoder": {"autoscaling": {"enabled": True, "minReplicas": 0}}},
    "tls without a secret": {"tls": {"enabled": True}},
    "api keys without a key name": {"apiKeys": {"secretName": "keys", "key": ""}},
    "chart-managed tls in a tier": {"encoder": {"config": {"tls": {"tls_cert": "/x"}}}},
    "unknown discovery": {"router": {"discovery": "consul"}},
    "spread without a topology key": {"decode": {"topologySpreadConstraints": [
        {"maxSkew": 1, "whenUnsatisfiable": "ScheduleAnyway"}]}},
    "ingress path not absolute": {"router": {"ingress": {"enabled": True, "hosts": [{"paths": [{"path": "v1"}]}]}}},
    "ingress tls without a secret": {"router": {"ingress": {"enabled": True, "tls": [{"hosts": ["a.example"]}]}}},
}
# what each refusal must name (the value's place, or the property): a refusal for another reason fails
BAD_VALUES_NAMED = {
    "negative replicas": "/encoder/replicas",
    "zero replicas": "/decode/replicas",
    "unknown transport": "/transport",
    "missing model": "missing property 'model'",
    "missing model source": "missing property 'source'",
    "unknown model source": "/model/source",
    "hub without a repo": "/model/hub/repo",
    "s3 without an s3 url": "/model/s3/url",
    "unknown preset": "/model/preset",
    "pvc without claim": "/model/pvc/claimName",
    "hostPath without path": "/model/hostPath/path",
    "relative model path": "/model/path",
    "typo in engine config": "'kv_cache_byte' not allowed",
    "zero tensor-parallel ranks": "/decode/config/engine/tensor_parallel_size",
    "chart-managed worker field": "'port' not allowed",
    "bad dtype": "/gpu/dtype",
    "unknown routing policy": "/router/config/encoder_policy",
    "negative queue": "/router/config/max_queued_requests",
    "bad port": "/workerPorts/grpc",
    "unknown top-level key": "'replicas' not allowed",
    "non-numeric gpus": "/gpu/count",
    "bad hpa bounds": "/encoder/autoscaling/minReplicas",
    "tls without a secret": "/tls/secretName",
    "api keys without a key name": "/apiKeys/key",
    "chart-managed tls in a tier": "'tls' not allowed",
    "unknown discovery": "/router/discovery",
    "spread without a topology key": "missing property 'topologyKey'",
    "ingress path not absolute": "/router/ingress/hosts/0/paths/0/path",
    "ingress tls without a secret": "missing property 'secretName'",
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_rejects_bad_values(case):
    values, named = BAD_VALUES[case], re.escape(BAD_VALUES_NAMED[case])
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match=named):
            chart.validate_schema(values)
    with pytest.raises(helm.HelmValuesError, match=named):
        render(values)
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"], f"lint accepted {case}: {values}"


def test_scaling_a_tier_leaves_the_router_untouched_with_dns_discovery():
    """The router follows the headless Services: a replica change renders the same router
    Deployment (no restart, no stream cut); with static discovery it would not."""
    def router_deployment(values: dict) -> dict:
        return by_kind(manifests(render(values)), "Deployment")["epd-router"]

    for tier in TIERS:
        assert router_deployment({tier: {"replicas": 4}}) == router_deployment({})
    static = {"router": {"discovery": "static"}}
    assert router_deployment({**static, "encoder": {"replicas": 4}}) != router_deployment(static)


def test_dns_discovery_with_mutual_tls_needs_a_server_name():
    no_name = {"enabled": True, "secretName": "epd-tls", "serverName": ""}  # the chart's default names one
    with pytest.raises(helm.HelmError, match="tls.serverName"):
        render({"tls": no_name})
    render({"tls": no_name, "router": {"discovery": "static"}})


def test_cuda_transports_need_gpus():
    with pytest.raises(helm.HelmError, match="gpu.enabled"):
        render({"transport": "nccl"})
    with pytest.raises(helm.HelmError, match="gpu.enabled"):
        render({"transport": "cuda_ipc"})


# ---------------------------------------------------------------------------- what the pods run

def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


_SECRET_DIRS = ("/var/run/secrets/epd/tls", "/var/run/secrets/epd/api-keys")


def _config_files(docs: list[dict], tmp_path: Path) -> dict[str, Path]:
    """The ConfigMap's files, with the mounted Secrets' paths moved under ``tmp_path`` (where
    stand-in files are made: the configs check that their key files exist)."""
    (cm,) = by_kind(docs, "ConfigMap").values()
    files = {}
    for key, text in cm["data"].items():
        for secret_dir in _SECRET_DIRS:
            for name in re.findall(re.escape(secret_dir) + r"/([\w.-]+)", text):
                (tmp_path / secret_dir.lstrip("/")).mkdir(parents=True, exist_ok=True)
                (tmp_path / secret_dir.lstrip("/") / name).write_text("-----BEGIN STAND-IN-----\n")
            text = text.replace(secret_dir, str(tmp_path / secret_dir.lstrip("/")))
        files[key] = tmp_path / key
        files[key].write_text(text)
    return files


@pytest.mark.parametrize("case", ["default", "gpu", "cpu", "hpa", "pvc", "scaled", "nccl", "secured"])
def test_processes_accept_the_rendered_configs(case, rendered, tmp_path, monkeypatch):
    """Each container's args + its ConfigMap file parse with EPD's own CLI/config code."""
    from epd.config import EncoderConfig
    from epd.server.router import router_config_from_args
    from epd.server.tier import worker_config_from_args

    docs = rendered[case]
    files = _config_files(docs, tmp_path)
    values = CASES[case]
    gpu = values.get("gpu", {}).get("enabled", False)

    router = _container(by_kind(docs, "Deployment")["epd-router"])
    assert router["args"][0] == "router"
    args = [str(files["router.yaml"]) if a == "/etc/epd/router.yaml" else a for a in router["args"][1:]]
    rc = router_config_from_args(args)
    assert (rc.host, rc.port, rc.grpc_port) == ("0.0.0.0", 8000, 50051)
    assert rc.transport == values.get("transport", "inline")
    for tier in TIERS:
        if values.get("router", {}).get("discovery", "dns") == "dns":  # the router follows the Service
            assert getattr(rc, f"{tier}_service") == f"epd-{tier}-headless.{NAMESPACE}.svc.cluster.local:50051"
            assert getattr(rc, f"{tier}s") == ()
            continue
        auto = values.get(tier, {}).get("autoscaling", {})
        slots = auto["maxReplicas"] if auto.get("enabled") else values.get(tier, {}).get("replicas", 1)
        assert getattr(rc, f"{tier}s") == tuple(
            f"epd-{tier}-{i}.epd-{tier}-headless.{NAMESPACE}.svc.cluster.local:50051" for i in range(slots))
    for key, value in values.get("router", {}).get("config", {}).items():
        assert getattr(rc, key) == (tuple(value) if isinstance(value, list) else value)

    for tier in TIERS:
        sts = by_kind(docs, "StatefulSet")[f"epd-{tier}"]
        assert sts["spec"]["serviceName"] == f"epd-{tier}-headless"
        c = _container(sts)
        assert c["args"][:3] == [tier, "--config", f"/etc/epd/{tier}.yaml"]
        assert _arg(c["args"], "--host") == "$(POD_IP)"
        assert any(e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
                   for e in c["env"])
        argv = [str(files[f"{tier}.yaml"]) if a == f"/etc/epd/{tier}.yaml" else a for a in c["args"][1:]]
        argv = ["10.1.2.3" if a == "$(POD_IP)" else a for a in argv]
        # the worker sees the GPUs its pod asks for (a tensor-parallel one checks it has one per rank)
        pod_gpus = int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: pod_gpus)
        wc = worker_config_from_args(tier, argv)
        assert (wc.host, wc.port, wc.metrics_port) == ("10.1.2.3", 50051, 9090)
        # decode's TCP link for the routers' token streams: a fixed port, open to them, only on decode
        assert wc.stream_port == (50052 if tier == "decode" else 0)
        assert ({p["name"]: p["containerPort"] for p in c["ports"]}.get("stream") ==
                (50052 if tier == "decode" else None))
        assert wc.model == rc.model
        # one model_name label on every process's metrics: the router's first public name
        assert wc.public_model_name == (rc.served_model_name or (rc.model,))[0]
        assert wc.transport == rc.transport
        if tier == "encoder":
            assert wc.encoder.device.startswith("cuda") == gpu
        else:  # no encoder settings for the other tiers, but for prefill where the encoder cache store is
            store_only = EncoderConfig().model_copy(update=dict(
                encoder_cache_store="mooncake", mooncake_master=wc.encoder.mooncake_master))
            with_store = tier == "prefill" and values.get("encoderCacheStore", {}).get("enabled")
            assert wc.encoder == (store_only if with_store else EncoderConfig())
            assert (wc.engine.device == "cuda") == gpu
            if gpu:
                assert wc.engine.dtype == values["gpu"].get("dtype", "bfloat16")
        limits = c["resources"].get("limits", {})
        if gpu:
            per_rank = values.get(tier, {}).get("gpus", values["gpu"].get("count", 1))
            ranks = 1 if tier == "encoder" else wc.engine.tensor_parallel_size
            assert limits["nvidia.com/gpu"] == per_rank * ranks
            tolerations = sts["spec"]["template"]["spec"]["tolerations"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
        else:
            assert "nvidia.com/gpu" not in limits
        if auto_on := values.get(tier, {}).get("autoscaling", {}).get("enabled"):
            assert "replicas" not in sts["spec"], auto_on
        else:
            assert sts["spec"]["replicas"] == values.get(tier, {}).get("replicas", 1)
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})


def test_the_secured_chart_wires_secrets_and_network_policies(rendered, tmp_path):
    """tls: every pod mounts the Secret and every process config points at it, with the one
    server name; apiKeys: the router mounts its Secret as a directory (updated in place, so a
    rotated key needs no restart) and reads it as api_key_file; networkPolicy: workers admit
    only this release's pods on gRPC, the router admits routerFrom."""
    from epd.server.router import router_config_from_args
    from epd.server.tier import worker_config_from_args

    docs = rendered["secured"]
    files = _config_files(docs, tmp_path)
    root = tmp_path / "var/run/secrets/epd"
    router_doc = by_kind(docs, "Deployment")["epd-router"]
    rc = router_config_from_args([str(files["router.yaml"]) if a == "/etc/epd/router.yaml" else a
                                  for a in _container(router_doc)["args"][1:]])
    assert rc.api_key_file == str(root / "api-keys/keys")
    expected_tls = {"tls_cert": str(root / "tls/tls.crt"), "tls_key": str(root / "tls/tls.key"),
                    "tls_ca": str(root / "tls/ca.crt"), "tls_server_name": "epd.serving.internal"}
    assert rc.tls.model_dump() == expected_tls
    for tier in TIERS:
        wc = worker_config_from_args(tier, ["--config", str(files[f"{tier}.yaml"]), "--host", "10.1.2.3"])
        assert wc.tls.model_dump() == expected_tls
    for doc in [router_doc, *by_kind(docs, "StatefulSet").values()]:
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "epd-tls"
        mounts = {m["name"]: m for m in _container(doc)["volumeMounts"]}
        assert mounts["tls"]["mountPath"] == "/var/run/secrets/epd/tls" and mounts["tls"]["readOnly"]
        assert ("api-keys" in volumes) == (doc is router_doc)
    assert "subPath" not in {m["name"]: m for m in _container(router_doc)["volumeMounts"]}["api-keys"]
    policies = by_kind(docs, "NetworkPolicy")
    assert set(policies) == {"epd-router", "epd-mooncake", *(f"epd-{t}" for t in TIERS)}  # + the encoder cache store
    for tier in TIERS:
        grpc_rule, metrics_rule = policies[f"epd-{tier}"]["spec"]["ingress"]
        assert grpc_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE,
                                                                      "app.kubernetes.io/part-of": "epd"}}}]
        assert grpc_rule["ports"] == [{"port": 50051, "protocol": "TCP"},
                                      *([{"port": 50052, "protocol": "TCP"}] if tier == "decode" else [])]
        assert "from" not in metrics_rule and metrics_rule["ports"] == [{"port": 9090, "protocol": "TCP"}]
    (router_rule,) = policies["epd-router"]["spec"]["ingress"]
    assert router_rule["from"] == CASES["secured"]["networkPolicy"]["routerFrom"]
    # the pods carry the labels the worker policies admit
    for doc in [router_doc, *by_kind(docs, "StatefulSet").values()]:
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE and labels["app.kubernetes.io/part-of"] == "epd"
    assert not by_kind(rendered["default"], "NetworkPolicy")


def test_probes_use_the_health_endpoints(rendered):
    docs = rendered["default"]
    router = _container(by_kind(docs, "Deployment")["epd-router"])
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["livenessProbe"]["httpGet"]["port"] == "http"
    assert router["livenessProbe"]["httpGet"]["path"] != "/health"  # a worker outage must not kill the router
    assert router["startupProbe"]["tcpSocket"] == {"port": "http"}
    for tier in TIERS:
        c = _container(by_kind(docs, "StatefulSet")[f"epd-{tier}"])
        assert c["readinessProbe"]["tcpSocket"] == {"port": "grpc"}
        assert c["startupProbe"]["tcpSocket"] == {"port": "grpc"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": 50051, "metrics": 9090, **({"stream": 50052} if tier == "decode" else {})}


def test_headless_services_publish_every_worker(rendered):
    for tier in TIERS:
        svc = by_kind(rendered["default"], "Service")[f"epd-{tier}-headless"]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == tier
        assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "metrics", *(["stream"] if tier == "decode" else [])}
    router = by_kind(rendered["scaled"], "Service")["epd-router"]
    assert router["spec"]["type"] == "NodePort"
    assert {p["name"]: p.get("nodePort") for p in router["spec"]["ports"]} == {"http": 30800, "grpc": None}


def test_pods_get_shm_cache_and_config_volumes(rendered):
    docs = rendered["default"]
    for doc in [*by_kind(docs, "StatefulSet").values(), *by_kind(docs, "Deployment").values()]:
        spec = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["config"]["configMap"]["name"] == "epd-config"
        mounts = {m["name"]: m["mountPath"] for m in _container(doc)["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm" and mounts["config"] == "/etc/epd" and mounts["cache"] == "/var/cache/epd"
        assert "model" not in volumes  # preset: nothing to mount
        assert "checksum/config" in doc["spec"]["template"]["metadata"]["annotations"]


@pytest.mark.parametrize("case,kind", [("pvc", "persistentVolumeClaim"), ("hostpath", "hostPath")])
def test_model_volume(case, kind, rendered):
    model = CASES[case]["model"]
    for doc in [*by_kind(rendered[case], "StatefulSet").values(), *by_kind(rendered[case], "Deployment").values()]:
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        assert list(volumes["model"]) == ["name", kind]
        mount = next(m for m in _container(doc)["volumeMounts"] if m["name"] == "model")
        assert mount["mountPath"] == model["path"] and mount["readOnly"] is True
        if kind == "persistentVolumeClaim":
            assert volumes["model"][kind] == {"claimName": "models", "readOnly": True}
            assert mount["subPath"] == "Qwen2-VL-2B"
        else:
            assert volumes["model"][kind] == {"path": "/data/Qwen2-VL-2B", "type": "Directory"}


def test_hpa_targets_each_tier(rendered):
    hpas = by_kind(rendered["hpa"], "HorizontalPodAutoscaler")
    assert set(hpas) == {f"epd-{t}" for t in ("router", *TIERS)}
    for name, hpa in hpas.items():
        kind = "Deployment" if name == "epd-router" else "StatefulSet"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": kind, "name": name}
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
        assert {m["resource"]["name"] for m in hpa["spec"]["metrics"]} == {"cpu", "memory"}
    assert "replicas" not in by_kind(rendered["hpa"], "Deployment")["epd-router"]["spec"]


def test_service_monitor_scrapes_router_and_workers(rendered):
    (sm,) = by_kind(rendered["servicemonitor"], "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert set(sm["spec"]) == {"namespaceSelector", "selector", "endpoints"}
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    ports = {e["port"]: e for e in sm["spec"]["endpoints"]}
    assert set(ports) == {"http", "metrics"}
    services = by_kind(rendered["servicemonitor"], "Service")
    assert [p["name"] for p in services["epd-router"]["spec"]["ports"]].count("http") == 1
    for e in ports.values():
        assert set(e) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "relabelings"}
        assert e["path"] == "/metrics"
        assert {r["targetLabel"] for r in e["relabelings"]} == {"epd_tier", "epd_release"}
        for r in e["relabelings"]:
            assert set(r) == {"sourceLabels", "targetLabel"}
            assert all(s.startswith("__meta_kubernetes_service_label_") for s in r["sourceLabels"])
    # its metadata is plain ObjectMeta: check it through a kind kubernetes-validate knows
    kv.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": sm["metadata"]}, KUBE_VERSION, strict=True)


def test_default_image_follows_the_chart_and_flavor(rendered):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    cpu_image = _container(by_kind(rendered["default"], "Deployment")["epd-router"])["image"]
    gpu_image = _container(by_kind(rendered["gpu"], "StatefulSet")["epd-decode"])["image"]
    assert cpu_image == f"epd:{project['version']}-cpu"
    assert gpu_image == f"epd:{project['version']}-cuda"
    own = _container(by_kind(manifests(render({"image": {"repository": "r.example/epd", "tag": "dev"},
                                                "encoder": {"image": {"tag": "enc"}}})),
                               "StatefulSet")["epd-encoder"])
    assert own["image"] == "r.example/epd:enc"


def test_notes_warn_about_same_host_transports():
    notes = render({"transport": "shm"})["epd/templates/NOTES.txt"]
    assert "WARNING: transport=shm" in notes
    assert "WARNING" not in render({})["epd/templates/NOTES.txt"]


# ---------------------------------------------------------------------------- the schema follows the code

def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_schema_knows_every_config_field():
    from epd.config import EncoderConfig, EngineConfig, RouterConfig, WorkerConfig

    defs = _schema()["definitions"]

    def fields(cls, minus=()):
        return set(cls.model_fields) - set(minus)

    assert set(defs["engineConfig"]["properties"]) == fields(EngineConfig)
    assert set(defs["encoderConfig"]["properties"]) == fields(EncoderConfig)
    assert set(defs["workerConfig"]["properties"]) == fields(
        WorkerConfig, minus=("model", "served_model_name", "host", "port", "metrics_port", "stream_port", "transport", "tls",
                             "host_id"))  # a pod is its own host (its own /dev/shm): the default says so
    # set by the chart itself (listeners and media policy come as arguments), or not for a chart at all;
    # API keys are a secret, never a ConfigMap value: a chart mounts them as api_key_file; tls comes
    # from the chart's own tls block (a mounted Secret)
    assert set(defs["routerConfig"]["properties"]) == fields(
        RouterConfig, minus=("model", "transport", "encoders", "prefills", "decodes", "encoder_service",
                             "prefill_service", "decode_service", "host", "port", "grpc_port",
                             "allowed_local_media_path", "allow_private_network", "aggregated", "engine",
                             "api_keys", "tls",
                             # epd serve's own for its --routers: a pod is one router (router.replicas)
                             "http_fd", "router_index", "public_grpc"))


def test_schema_enums_follow_the_registries():
    from epd.engine.attention import ATTENTION_BACKENDS, AUTO
    from epd.models.null.checkpoint import NULL_PRESETS
    from epd.models.presets import PRESETS
    from epd.router.routing import ROUTING_POLICIES
    from epd.transport.base import exporting_transports

    schema = _schema()
    props, defs = schema["properties"], schema["definitions"]
    assert sorted(props["transport"]["enum"]) == sorted(exporting_transports())
    assert sorted(props["model"]["properties"]["preset"]["enum"]) == sorted([*PRESETS, *NULL_PRESETS])
    assert sorted(defs["routerConfig"]["properties"]["encoder_policy"]["enum"]) == sorted(ROUTING_POLICIES.names())
    assert sorted(defs["engineConfig"]["properties"]["attention_backend"]["enum"]) == sorted(
        [AUTO, *ATTENTION_BACKENDS.names()])


def test_values_files_are_complete_and_valid():
    """Every key the chart's values.yaml has is described by the schema (additionalProperties: false)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    with helm.Chart.load(CHART) as chart:
        assert chart.values == defaults
        for name in ("values-gpu.yaml", "values-cpu.yaml"):
            merged = chart.merge_values(_file_values(name))
            chart.validate_schema(copy.deepcopy(merged))


def test_the_router_waits_for_endpoints_then_drains_within_the_grace_period(rendered):
    """preStop sleep (endpoints stop sending), then SIGTERM: no new requests, streams finish within
    shutdown_grace_s; the pod's grace period covers both, as the workers' covers their drain."""
    from epd.config import RouterConfig, WorkerConfig

    docs = rendered["default"]
    router = by_kind(docs, "Deployment")["epd-router"]
    pod = router["spec"]["template"]["spec"]
    sleep_s = int(_container(router)["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= sleep_s + RouterConfig().shutdown_grace_s
    for tier in TIERS:
        grace = by_kind(docs, "StatefulSet")[f"epd-{tier}"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > WorkerConfig().drain_timeout_s
    assert "lifecycle" not in _container(by_kind(manifests(render({"router": {"preStopSleepSeconds": 0}})),
                                                 "Deployment")["epd-router"])


def test_ingress_serves_the_http_api(rendered):
    assert not by_kind(rendered["default"], "Ingress")
    ingress = by_kind(rendered["exposed"], "Ingress")["epd-router"]
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == CASES["exposed"]["router"]["ingress"]["tls"]
    assert ingress["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/proxy-buffering": "off"}
    (rule,) = spec["rules"]
    assert rule["host"] == "epd.example.com"
    (path,) = rule["http"]["paths"]
    assert path == {"path": "/v1", "pathType": "Prefix",
                    "backend": {"service": {"name": "epd-router", "port": {"name": "http"}}}}
    ports = {p["name"] for p in by_kind(rendered["exposed"], "Service")["epd-router"]["spec"]["ports"]}
    assert "http" in ports
    # the default host entry has no host: a catch-all rule, not an empty host name
    (rule,) = by_kind(manifests(render({"router": {"ingress": {"enabled": True}}})), "Ingress")["epd-router"]["spec"]["rules"]
    assert "host" not in rule and rule["http"]["paths"][0]["path"] == "/"


def test_spread_constraints_select_their_own_tier_and_runtime_class_falls_back(rendered):
    docs = rendered["exposed"]
    pods = {name: d["spec"]["template"]["spec"] for kind in ("Deployment", "StatefulSet")
            for name, d in by_kind(docs, kind).items()}
    assert pods["epd-router"]["runtimeClassName"] == "runc"  # the tier's own wins
    for tier in TIERS:
        assert pods[f"epd-{tier}"]["runtimeClassName"] == "nvidia"
    (router_spread,) = pods["epd-router"]["topologySpreadConstraints"]
    assert router_spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    own, named = pods["epd-decode"]["topologySpreadConstraints"]
    assert own["labelSelector"]["matchLabels"] == by_kind(docs, "StatefulSet")["epd-decode"]["spec"]["selector"]["matchLabels"]
    assert own["whenUnsatisfiable"] == "DoNotSchedule"
    assert named["labelSelector"] == {"matchLabels": {"pool": "decode"}}
    assert "topologySpreadConstraints" not in pods["epd-encoder"]
    for doc in rendered["default"]:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            spec = doc["spec"]["template"]["spec"]
            assert "runtimeClassName" not in spec and "topologySpreadConstraints" not in spec


def test_a_model_from_the_hub_or_s3_is_downloaded_by_an_init_container_into_the_pods_model_volume(rendered):
    """Every pod that loads the model (the router reads its tokenizer too) first runs fetch-model:
    hf download (the EPD image, online for this container only, the token from a Secret) or aws s3
    sync (credentials from a Secret), into an emptyDir the main container mounts read-only."""
    for case, expected in (("hub", ["hf", "download", "Qwen/Qwen2-VL-7B-Instruct", "--revision", "main",
                                    "--local-dir", "/models/qwen2-vl-7b"]),
                           ("s3", ["aws", "s3", "sync", "s3://models/Qwen2-VL-7B-Instruct", "/models/qwen2-vl-7b",
                                   "--only-show-errors", "--endpoint-url", "https://minio.example:9000"])):
        pods = [d for d in rendered[case] if d["kind"] in ("StatefulSet", "Deployment")]
        assert len(pods) == 4, case
        for doc in pods:
            spec = doc["spec"]["template"]["spec"]
            (init,) = spec["initContainers"]
            assert init["command"] == expected, (case, init["command"])
            volume = next(v for v in spec["volumes"] if v["name"] == "model")
            assert volume == {"name": "model", "emptyDir": {"sizeLimit": "100Gi"}}
            assert {"name": "model", "mountPath": "/models/qwen2-vl-7b"} in init["volumeMounts"]
            main = spec["containers"][0]
            assert {"name": "model", "mountPath": "/models/qwen2-vl-7b", "readOnly": True} in main["volumeMounts"]
            if case == "hub":
                env = {e["name"]: e for e in init["env"]}
                assert env["HF_HUB_OFFLINE"]["value"] == "0"
                assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
                assert init["image"] == main["image"]
                tier = doc["metadata"]["labels"]["app.kubernetes.io/component"]
                assert spec["priorityClassName"] == ("serving-critical" if tier == "decode" else "serving")
            else:
                assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
                assert init["image"].startswith("amazon/aws-cli:")
    for doc in rendered["default"]:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            assert "initContainers" not in doc["spec"]["template"]["spec"]
            assert "priorityClassName" not in doc["spec"]["template"]["spec"]


def test_keda_scales_each_tier_on_its_queue_under_vllms_names(rendered):
    """A ScaledObject per tier on its StatefulSet (the router's Deployment), querying the tier's
    queue (vLLM's vllm:num_requests_waiting; the encoders' own queue), its pods' replicas left to
    KEDA and the router given every slot it may fill; not together with the HPA."""
    docs = rendered["keda"]
    scaled = by_kind(docs, "ScaledObject")
    assert len(scaled) == 4 and not by_kind(docs, "HorizontalPodAutoscaler")
    for name, obj in scaled.items():
        tier = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        spec = obj["spec"]
        target = by_kind(docs, spec["scaleTargetRef"]["kind"])[spec["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"] and spec["maxReplicaCount"] == 6
        (trigger,) = spec["triggers"]
        metric = "epd_encoder_queue_depth" if tier == "encoder" else "vllm:num_requests_waiting"
        assert trigger["metadata"]["query"] == (f'sum({metric}{{namespace="{NAMESPACE}", epd_release="{RELEASE}", '
                                                f'epd_tier="{tier}"}})'), trigger
        assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"].startswith("http")
    exported = {name for name in _exported_metric_names()}
    assert {"vllm:num_requests_waiting", "epd_encoder_queue_depth"} <= exported
    with pytest.raises(Exception, match="keda.enabled and autoscaling.enabled both scale the same pods"):
        render({"decode": {"keda": {"enabled": True}, "autoscaling": {"enabled": True}}})


def test_keda_from_the_planner_scales_a_tier_to_the_workers_the_router_wants():
    """keda.fromPlanner: the tier's replicas are the router's planner's desired workers for it (one
    pod a worker); without a planner (router.config.autoscale_budget) it is refused."""
    docs = manifests(render({"router": {"config": {"autoscale_budget": 6}},
                             "decode": {"keda": {"enabled": True, "fromPlanner": True}}}))
    (obj,) = by_kind(docs, "ScaledObject").values()
    (trigger,) = obj["spec"]["triggers"]
    assert trigger["metadata"]["query"] == (f'max(epd_planner_desired_workers{{namespace="{NAMESPACE}", '
                                            f'epd_release="{RELEASE}", tier="decode"}})')
    assert trigger["metadata"]["threshold"] == "1"
    assert "epd_planner_desired_workers" in _exported_metric_names()
    with pytest.raises(Exception, match="decode.keda.fromPlanner reads the router's planner: set "
                                        "router.config.autoscale_budget"):
        render({"decode": {"keda": {"enabled": True, "fromPlanner": True}}})


def _exported_metric_names() -> set[str]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.prom import every_registry
    return {family.name for registry in every_registry().values()
            for family in text_string_to_metric_families(generate_latest(registry).decode())}


def test_the_encoder_cache_store_is_run_by_the_chart_or_pointed_at(rendered, tmp_path):
    """encoderCacheStore: the chart runs a master and a segment server (one pod, a Service, its own
    NetworkPolicy) and points every encoder and prefill worker at it; with ``master`` given it runs
    nothing and points them there; off, encoders keep their own caches only."""
    from epd.server.tier import worker_config_from_args

    def encoder_config(case: str, tier: str = "encoder"):
        (tmp_path / case / tier).mkdir(parents=True)
        files = _config_files(rendered[case], tmp_path / case / tier)
        return worker_config_from_args(tier, ["--config", str(files[f"{tier}.yaml"])]).encoder

    run = rendered["secured"]
    (store,) = [d for d in by_kind(run, "Deployment").values() if d["metadata"]["name"] == "epd-mooncake"]
    containers = {c["name"]: c for c in store["spec"]["template"]["spec"]["containers"]}
    assert containers["master"]["command"] == ["mooncake_master"]
    assert "-rpc_port=50061" in containers["master"]["args"]
    assert containers["segment"]["command"] == ["mooncake_client"]
    assert "-global_segment_size=4294967296" in containers["segment"]["args"]
    assert "-master_server_address=$(POD_IP):50061" in containers["segment"]["args"]
    assert by_kind(run, "Service")["epd-mooncake"]["spec"]["ports"][0]["port"] == 50061
    assert "epd-mooncake" in by_kind(run, "NetworkPolicy")
    config = encoder_config("secured")
    assert (config.encoder_cache_store, config.mooncake_master) == \
        ("mooncake", f"epd-mooncake.{NAMESPACE}.svc.cluster.local:50061")
    # prefill reads rows from it too (store handles); decode has nothing to do with it
    assert encoder_config("secured", "prefill").mooncake_master == config.mooncake_master
    assert encoder_config("secured", "decode").encoder_cache_store == "local"
    pointed = rendered["nccl"]
    assert "epd-mooncake" not in by_kind(pointed, "Deployment")
    assert encoder_config("nccl").mooncake_master == "mooncake-master.stores.svc:50061"
    assert "epd-mooncake" not in by_kind(rendered["default"], "Deployment")
    assert encoder_config("default").encoder_cache_store == "local"
