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


def test_cross_references(built) -> None:
    overlay, docs = built
    dep = one(docs, "Deployment", "pagestream-engine")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert _matches(dep["spec"]["selector"]["matchLabels"], labels)
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}

    # Service -> pods and a named container port; Ingress -> Service port.
    svc = one(docs, "Service", "pagestream-engine")
    assert _matches(svc["spec"]["selector"], labels)
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for p in svc_ports.values():
        assert p["targetPort"] in ports or p["targetPort"] in ports.values()
    ing = one(docs, "Ingress", "pagestream")
    for rule in ing["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == "pagestream-engine"
            assert backend["port"]["name"] in svc_ports
    hash_by = ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert "$http_x_session_id" in hash_by

    # Probes: real routes of the server, on a declared port.
    routes = _routes()
    for probe in ("readinessProbe", "livenessProbe"):
        get = engine[probe]["httpGet"]
        assert get["path"] in routes, f"{probe} {get['path']} is not a route"
        assert get["port"] in ports
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    assert engine["livenessProbe"]["httpGet"]["path"] != "/health"  # 503 while draining
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/path"] in routes
    assert int(ann["prometheus.io/port"]) in ports.values()

    # Shutdown: preStop + the server's drain deadline fit in the grace period.
    args = engine.get("args", [])
    shutdown = float(_flag(args, "--shutdown-timeout", "30"))
    pre_stop = engine["lifecycle"]["preStop"]["exec"]["command"]
    pre = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > shutdown + pre + 5, (grace, shutdown, pre)

    # Volumes mounted exist; the model path is under the model mount.
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    for m in engine["volumeMounts"]:
        assert m["name"] in vols, m
    model = _flag(args, "--model")
    mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
    assert model and any(model.startswith(p + "/") for p in mounts)
    pvc = vols["models"]["persistentVolumeClaim"]["claimName"]
    one(docs, "PersistentVolumeClaim", pvc)
    keys = _flag(args, "--api-key-file")
    assert keys and any(keys.startswith(p + "/") for p in mounts)

    # Redis: the URL names its Service and port; capped memory under the pod's limit.
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    m = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", env["PAGESTREAM_REDIS_URL"])
    assert m
    rsvc = one(docs, "Service", m.group(1))
    assert int(m.group(2)) in [p["port"] for p in rsvc["spec"]["ports"]]
    rdep = one(docs, "Deployment", "pagestream-redis")
    rlabels = rdep["spec"]["template"]["metadata"]["labels"]
    assert _matches(rsvc["spec"]["selector"], rlabels)
    (redis,) = rdep["spec"]["template"]["spec"]["containers"]
    rargs = redis["args"]
    assert _flag(rargs, "--maxmemory-policy") == "allkeys-lru"
    maxmem = _bytes(_flag(rargs, "--maxmemory"))
    assert maxmem < _bytes(redis["resources"]["limits"]["memory"])
    netpol = one(docs, "NetworkPolicy", "pagestream-redis")
    assert _matches(netpol["spec"]["podSelector"]["matchLabels"], rlabels)
    assert _matches(netpol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"], labels)

    # PDB and HPA point at the engines; the HPA's metric is one the server exports and
    # the adapter rules publish.
    pdb = one(docs, "PodDisruptionBudget", "pagestream-engine")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], labels)
    hpa = one(docs, "HorizontalPodAutoscaler", "pagestream-engine")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "pagestream-engine")
    assert hpa["spec"]["minReplicas"] >= 2  # the PDB's maxUnavailable 1 leaves one serving
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert f'"{metric}"' in (ROOT / "service" / "metrics.py").read_text()
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    assert metric in [r["name"]["as"] for r in adapter["rules"]["custom"]]

    # GPUs only in the CUDA overlay, and the image tag follows the overlay.
    gpus = engine["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == "1") == (overlay == "cuda")
    assert engine["image"].endswith(":" + overlay)


def _bytes(v: str) -> int:
    m = re.fullmatch(r"(\d+)(gb|mb|Gi|Mi|G|M)?", v)
    assert m, v
    mult = {None: 1, "gb": 1 << 30, "mb": 1 << 20, "Gi": 1 << 30, "Mi": 1 << 20,
            "G": 10**9, "M": 10**6}  # fmt: skip
    return int(m.group(1)) * mult[m.group(2)]
