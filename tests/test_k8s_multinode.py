"""The multi-node overlay (deploy/k8s/overlays/multinode): it builds with `kubectl
kustomize` and every resource validates strictly offline (kubernetes-validate), and the
cross-references a schema cannot see hold: the group's size agrees with --nnodes and the
parallel sizes, every pod's node rank is its ordinal, the rendezvous address is pod 0's
stable name under the headless Service (published before readiness) and its ports are
declared, the API Service selects pod 0 alone, the probes are routes the server has, the
flags are ones `pagestream serve` accepts."""

from __future__ import annotations

import pytest

from service.cli import build_parser
from tests.test_k8s import _flag, _matches, _routes, _validate, build, one


@pytest.fixture(scope="module")
def docs():
    return build("multinode")


def test_builds_and_is_strictly_valid(docs) -> None:
    assert {d["kind"] for d in docs} == {
        "StatefulSet", "Service", "PodDisruptionBudget", "PersistentVolumeClaim",
        "NetworkPolicy",
    }  # fmt: skip
    for doc in docs:
        _validate(doc)


def _group(docs):
    sts = one(docs, "StatefulSet", "pagestream-group")
    pod = sts["spec"]["template"]
    (engine,) = pod["spec"]["containers"]
    return sts, pod, engine, engine["args"]


def test_group_size_and_ranks_agree(docs) -> None:
    sts, pod, engine, args = _group(docs)
    nnodes = int(_flag(args, "--nnodes"))
    assert sts["spec"]["replicas"] == nnodes
    ranks = int(_flag(args, "--pipeline-parallel-size")) * int(
        _flag(args, "--tensor-parallel-size")
    )
    assert ranks % nnodes == 0
    gpus = engine["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == ranks // nnodes  # one GPU per rank on each host
    # Every pod's node rank is its ordinal (pods start together: none waits for another).
    assert _flag(args, "--node-rank") == "$(NODE_RANK)"
    env = {e["name"]: e for e in engine["env"]}
    field = env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    # The flags are serve's own.
    parsed = build_parser().parse_args(["serve", *(a.replace("$(NODE_RANK)", "1") for a in args)])
    assert (parsed.nnodes, parsed.node_rank) == (nnodes, 1)
    # One pod per host.
    anti = pod["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert _matches(anti[0]["labelSelector"]["matchLabels"], pod["metadata"]["labels"])


def test_rendezvous_reaches_pod_zero(docs) -> None:
    sts, pod, engine, args = _group(docs)
    headless = one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert _matches(headless["spec"]["selector"], pod["metadata"]["labels"])
    name = sts["metadata"]["name"]
    assert _flag(args, "--master-addr") == f"{name}-0.{headless['metadata']['name']}"
    port = int(_flag(args, "--master-port"))
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    # The rendezvous, then the step connections on the next port (gpu/tp_executor.py).
    assert ports["rendezvous"] == port and ports["steps"] == port + 1
    assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"rendezvous", "steps"}


def test_api_reaches_pod_zero_alone(docs) -> None:
    _sts, pod, engine, _args = _group(docs)
    api = one(docs, "Service", "pagestream-engine")
    sel = api["spec"]["selector"]
    assert sel.pop("apps.kubernetes.io/pod-index") == "0"
    assert _matches(sel, pod["metadata"]["labels"])
    ports = {p["name"] for p in engine["ports"]}
    assert all(p["targetPort"] in ports for p in api["spec"]["ports"])
    routes = _routes()
    for probe in ("readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"]["path"] in routes
    pdb = one(docs, "PodDisruptionBudget", "pagestream-group")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    claim = {v["name"]: v for v in pod["spec"]["volumes"]}["models"]["persistentVolumeClaim"]
    one(docs, "PersistentVolumeClaim", claim["claimName"])
