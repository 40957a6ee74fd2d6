"""Kubernetes manifests under deploy/k8s: every resource, in the base and as each overlay
builds it (`kubectl kustomize`), validated strictly against the Kubernetes schema offline
(kubernetes-validate), plus the cross-references a schema cannot see: selectors match pod
labels, Service ports name container ports, probes hit routes the server has, the grace
period outlasts the drain, the HPA's metric is one the server exports.

kubectl missing: skipped on a developer machine, a failure under CI=true (.ci/run installs
Debian's kubernetes-client).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = ["cpu", "cuda"]
K8S_VERSION = "1.30.0"  # the oldest release the manifests promise to work on


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        msg = "kubectl is not installed (apt-get install -y kubernetes-client)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; CI must build the overlays")
        pytest.skip(msg)
    return exe


def build(overlay: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def built(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, build(request.param)


def _base_resources() -> list[dict[str, Any]]:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in _load(BASE / f)]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


# --------------------------------------------------------------------------- schema
def _validate(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {e.message}") from e


def test_base_resources_are_strictly_valid() -> None:
    docs = _base_resources()
    assert {d["kind"] for d in docs} >= {
        "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "Ingress",
        "PersistentVolumeClaim", "NetworkPolicy",
    }  # fmt: skip
    for doc in docs:
        _validate(doc)


def test_overlays_build_and_are_strictly_valid(built) -> None:
    _, docs = built
    for doc in docs:
        _validate(doc)


def test_strict_validation_rejects_a_typo() -> None:
    """The check can fail: a misspelt field is refused, not ignored."""
    import kubernetes_validate

    bad = one(_base_resources(), "Service", "pagestream-engine")
    bad = {**bad, "spec": {**bad["spec"], "selecter": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_cli_validates_every_base_file() -> None:
    exe = str(Path(sys.executable).with_name("kubernetes-validate"))
    if not Path(exe).exists():
        exe = shutil.which("kubernetes-validate") or exe
    files = sorted(str(p) for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    proc = subprocess.run(
        [exe, "--strict", "--quiet", "-k", K8S_VERSION, *files],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- cross refs
def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _routes() -> set[str]:
    from service.app import ServerConfig, create_app

    app = create_app(ServerConfig())
    return {r.resource.canonical for r in app.router.routes() if r.resource is not None}


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


@dataclass
class _Engine:
    """The engine Deployment's pod template, as every cross-reference test starts."""

    docs: list[dict[str, Any]]
    overlay: str
    pod: dict[str, Any]
    labels: dict[str, str]
    container: dict[str, Any]
    ports: dict[str, int]  # container port name -> number
    args: list[str]


def _engine(built: tuple[str, list[dict[str, Any]]]) -> _Engine:
    overlay, docs = built
    dep = one(docs, "Deployment", "pagestream-engine")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert _matches(dep["spec"]["selector"]["matchLabels"], labels)
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    return _Engine(docs, overlay, pod, labels, engine, ports, engine.get("args", []))


def test_service_and_ingress_reach_the_engine(built) -> None:
    """Service -> pods and a named container port; Ingress -> Service port."""
    e = _engine(built)
    svc = one(e.docs, "Service", "pagestream-engine")
    assert _matches(svc["spec"]["selector"], e.labels)
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for p in svc_ports.values():
        assert p["targetPort"] in e.ports or p["targetPort"] in e.ports.values()
    ing = one(e.docs, "Ingress", "pagestream")
    for rule in ing["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == "pagestream-engine"
            assert backend["port"]["name"] in svc_ports
    hash_by = ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert "$http_x_session_id" in hash_by


def test_probes_and_scrape_are_server_routes(built) -> None:
    """Probes: real routes of the server, on a declared port."""
    e = _engine(built)
    routes = _routes()
    for probe in ("readinessProbe", "livenessProbe"):
        get = e.container[probe]["httpGet"]
        assert get["path"] in routes, f"{probe} {get['path']} is not a route"
        assert get["port"] in e.ports
    assert e.container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert e.container["livenessProbe"]["httpGet"]["path"] != "/health"  # 503 while draining
    ann = e.pod["metadata"]["annotations"]
    assert ann["prometheus.io/path"] in routes
    assert int(ann["prometheus.io/port"]) in e.ports.values()


def test_drain_fits_the_grace_period(built) -> None:
    """Shutdown: preStop + the server's drain deadline fit in the grace period."""
    e = _engine(built)
    shutdown = float(_flag(e.args, "--shutdown-timeout", "30"))
    pre_stop = e.container["lifecycle"]["preStop"]["exec"]["command"]
    pre = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    grace = e.pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > shutdown + pre + 5, (grace, shutdown, pre)


def test_volumes_hold_the_model_and_keys(built) -> None:
    """Volumes mounted exist; the model path is under the model mount."""
    e = _engine(built)
    vols = {v["name"]: v for v in e.pod["spec"]["volumes"]}
    for m in e.container["volumeMounts"]:
        assert m["name"] in vols, m
    model = _flag(e.args, "--model")
    mounts = {m["mountPath"]: m for m in e.container["volumeMounts"]}
    assert model and any(model.startswith(p + "/") for p in mounts)
    pvc = vols["models"]["persistentVolumeClaim"]["claimName"]
    one(e.docs, "PersistentVolumeClaim", pvc)
    keys = _flag(e.args, "--api-key-file")
    assert keys and any(keys.startswith(p + "/") for p in mounts)
    # The Ingress passes the client's Host on: the pods must be told which to answer.
    assert _flag(e.args, "--allowed-hosts")


def test_redis_url_memory_and_network_policy(built) -> None:
    """Redis: the URL names its Service and port; capped memory under the pod's limit."""
    e = _engine(built)
    env = {v["name"]: v.get("value") for v in e.container.get("env", [])}
    m = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", env["PAGESTREAM_REDIS_URL"])
    assert m
    rsvc = one(e.docs, "Service", m.group(1))
    assert int(m.group(2)) in [p["port"] for p in rsvc["spec"]["ports"]]
    rdep = one(e.docs, "Deployment", "pagestream-redis")
    rlabels = rdep["spec"]["template"]["metadata"]["labels"]
    assert _matches(rsvc["spec"]["selector"], rlabels)
    (redis,) = rdep["spec"]["template"]["spec"]["containers"]
    rargs = redis["args"]
    assert _flag(rargs, "--maxmemory-policy") == "allkeys-lru"
    maxmem = _bytes(_flag(rargs, "--maxmemory"))
    assert maxmem < _bytes(redis["resources"]["limits"]["memory"])
    netpol = one(e.docs, "NetworkPolicy", "pagestream-redis")
    assert _matches(netpol["spec"]["podSelector"]["matchLabels"], rlabels)
    allowed = netpol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert _matches(allowed, e.labels)


def test_pdb_and_hpa_target_the_engines(built) -> None:
    """PDB and HPA point at the engines; the HPA's metric is one the server exports and
    the adapter rules publish."""
    e = _engine(built)
    pdb = one(e.docs, "PodDisruptionBudget", "pagestream-engine")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], e.labels)
    hpa = one(e.docs, "HorizontalPodAutoscaler", "pagestream-engine")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "pagestream-engine")
    assert hpa["spec"]["minReplicas"] >= 2  # the PDB's maxUnavailable 1 leaves one serving
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert f'"{metric}"' in (ROOT / "service" / "metrics.py").read_text()
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    assert metric in [r["name"]["as"] for r in adapter["rules"]["custom"]]


def test_gpus_and_image_follow_the_overlay(built) -> None:
    """GPUs only in the CUDA overlay, and the image tag follows the overlay."""
    e = _engine(built)
    gpus = e.container["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == "1") == (e.overlay == "cuda")
    assert e.container["image"].endswith(":" + e.overlay)


def _bytes(v: str) -> int:
    m = re.fullmatch(r"(\d+)(gb|mb|Gi|Mi|G|M)?", v)
    assert m, v
    mult = {None: 1, "gb": 1 << 30, "mb": 1 << 20, "Gi": 1 << 30, "Mi": 1 << 20,
            "G": 10**9, "M": 10**6}  # fmt: skip
    return int(m.group(1)) * mult[m.group(2)]
