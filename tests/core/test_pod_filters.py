"""kube-scheduler's filters as the preemption controller checks them (gpupack.core.pod_filters):
per filter, a case that passes, one that fails, and one that the victims' removal fixes (or, for
pod affinity, breaks)."""

from __future__ import annotations

from typing import Any

import pytest

from gpupack.core import pod_filters as pf

NODES = {
    "n1": pf.NodeFacts("n1", {"zone": "a", "host": "n1"}),
    "n2": pf.NodeFacts("n2", {"zone": "a", "host": "n2"}),
    "n3": pf.NodeFacts("n3", {"zone": "b", "host": "n3"}, frozenset({("gpu", "", "NoSchedule")})),
    "n4": pf.NodeFacts("n4", {"zone": "b", "host": "n4"}),
    "bare": pf.NodeFacts("bare", {}),
}
NS = {"ns": {"team": "x"}, "other": {"team": "y"}}


def ns_labels(ns: str) -> dict[str, str] | None:
    return NS.get(ns)


def pod(
    name: str = "pre", ns: str = "ns", labels: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "labels": labels or {}}, "spec": spec}


def on(name: str, node: str, ns: str = "ns", labels: dict[str, str] | None = None, **spec: Any) -> pf.Placed:
    return pf.placed(pod(name, ns, labels, nodeName=node, **spec))


def term(key: str, labels: dict[str, str], **kw: Any) -> dict[str, Any]:
    return {"topologyKey": key, "labelSelector": {"matchLabels": labels}, **kw}


def affinity(kind: str, *terms: dict[str, Any]) -> dict[str, Any]:
    return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}


def port(p: int, proto: str = "TCP", ip: str = "") -> dict[str, Any]:
    return {"name": "c", "ports": [{"containerPort": 80, "hostPort": p, "protocol": proto, "hostIP": ip}]}


def spread(key: str, labels: dict[str, str], skew: int = 1, **kw: Any) -> dict[str, Any]:
    return {
        "maxSkew": skew,
        "topologyKey": key,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": labels},
        **kw,
    }


WEB = {"app": "web"}
CASES: list[tuple[str, dict[str, Any], str, list[pf.Placed], str | None]] = [
    # node affinity and selectors, taints: no pod leaving changes them
    ("selector passes", pod(nodeSelector={"zone": "a"}), "n1", [], None),
    ("selector fails", pod(nodeSelector={"zone": "b"}), "n1", [], pf.NODE_AFFINITY),
    ("taint fails", pod(), "n3", [], pf.TAINT),
    (
        "taint tolerated",
        pod(tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]),
        "n3",
        [],
        None,
    ),
    # host ports
    ("port free", pod(containers=[port(8080)]), "n1", [on("x", "n1", containers=[port(9090)])], None),
    ("port taken", pod(containers=[port(8080)]), "n1", [on("x", "n1", containers=[port(8080)])], pf.PORTS),
    (
        "port taken elsewhere",
        pod(containers=[port(8080)]),
        "n1",
        [on("x", "n2", containers=[port(8080)])],
        None,
    ),
    (
        "port on another protocol",
        pod(containers=[port(53)]),
        "n1",
        [on("x", "n1", containers=[port(53, "UDP")])],
        None,
    ),
    (
        "port on another IP",
        pod(containers=[port(80, ip="10.0.0.1")]),
        "n1",
        [on("x", "n1", containers=[port(80, ip="10.0.0.2")])],
        None,
    ),
    ("port freed by the victim", pod(containers=[port(8080)]), "n1", [], None),  # the holder was the victim
    # required pod affinity
    (
        "affinity met",
        pod(affinity=affinity("podAffinity", term("zone", WEB))),
        "n1",
        [on("w", "n2", labels=WEB)],
        None,
    ),
    (
        "affinity met in another zone only",
        pod(affinity=affinity("podAffinity", term("zone", WEB))),
        "n1",
        [on("w", "n3", labels=WEB)],
        pf.AFFINITY,
    ),
    (
        "affinity to a label no pod has",
        pod(affinity=affinity("podAffinity", term("zone", {"app": "nobody"}))),
        "n1",
        [on("w", "n1", labels=WEB)],
        pf.AFFINITY,
    ),
    (
        "affinity node without the key",
        pod(affinity=affinity("podAffinity", term("zone", WEB))),
        "bare",
        [on("w", "n1", labels=WEB)],
        pf.AFFINITY,
    ),
    (
        "affinity: the first of a series matching itself",
        pod(labels=WEB, affinity=affinity("podAffinity", term("zone", WEB))),
        "n1",
        [],
        None,
    ),
    (
        "affinity in another namespace, not named",
        pod(affinity=affinity("podAffinity", term("zone", WEB))),
        "n1",
        [on("w", "n1", ns="other", labels=WEB)],
        pf.AFFINITY,
    ),
    (
        "affinity in a namespace its selector picks",
        pod(
            affinity=affinity(
                "podAffinity", term("zone", WEB, namespaceSelector={"matchLabels": {"team": "y"}})
            )
        ),
        "n1",
        [on("w", "n1", ns="other", labels=WEB)],
        None,
    ),
    # required anti-affinity, the pod's own
    (
        "anti-affinity: none near",
        pod(affinity=affinity("podAntiAffinity", term("host", WEB))),
        "n1",
        [on("w", "n2", labels=WEB)],
        None,
    ),
    (
        "anti-affinity: one on the node",
        pod(affinity=affinity("podAntiAffinity", term("host", WEB))),
        "n1",
        [on("w", "n1", labels=WEB)],
        pf.ANTI_AFFINITY,
    ),
    (
        "anti-affinity: one in the zone",
        pod(affinity=affinity("podAntiAffinity", term("zone", WEB))),
        "n1",
        [on("w", "n2", labels=WEB)],
        pf.ANTI_AFFINITY,
    ),
    (
        "anti-affinity: an unknown namespace counts against",
        pod(affinity=affinity("podAntiAffinity", term("host", WEB, namespaceSelector={}))),
        "n1",
        [on("w", "n1", ns="ghost", labels=WEB)],
        pf.ANTI_AFFINITY,
    ),
    # required anti-affinity of the pods that stay
    (
        "existing anti-affinity: not against it",
        pod(labels={"app": "db"}),
        "n1",
        [on("w", "n1", affinity=affinity("podAntiAffinity", term("host", WEB)))],
        None,
    ),
    (
        "existing anti-affinity: against it",
        pod(labels=WEB),
        "n1",
        [on("w", "n1", affinity=affinity("podAntiAffinity", term("host", WEB)))],
        pf.EXISTING_ANTI_AFFINITY,
    ),
    (
        "existing anti-affinity: another host",
        pod(labels=WEB),
        "n1",
        [on("w", "n2", affinity=affinity("podAntiAffinity", term("host", WEB)))],
        None,
    ),
    # hard topology spread
    (
        "spread: even",
        pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB)]),
        "n4",
        [on("w", "n1", labels=WEB)],
        None,
    ),
    (
        "spread: skewed",
        pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB)]),
        "n1",
        [on("w", "n1", labels=WEB)],
        pf.SPREAD,
    ),
    (
        "spread: soft constraints do not filter",
        pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB, whenUnsatisfiable="ScheduleAnyway")]),
        "n1",
        [on("w", "n1", labels=WEB)],
        None,
    ),
    (
        "spread: a terminating pod does not count",
        pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB)]),
        "n1",
        [pf.Placed("ns/w", "ns", "n1", WEB, terminating=True)],
        None,
    ),
    (
        "spread: node without the key",
        pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB)]),
        "bare",
        [],
        pf.SPREAD_LABEL,
    ),
    (
        "spread: minDomains not reached",
        pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB, minDomains=3)]),
        "n4",
        [on("w", "n1", labels=WEB), on("w2", "n3", labels=WEB)],
        pf.SPREAD,
    ),
    (
        "spread: minDomains reached",
        pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB, minDomains=2)]),
        "n4",
        [on("w", "n1", labels=WEB), on("w2", "n3", labels=WEB)],
        None,
    ),
]


@pytest.mark.parametrize(
    ("pre", "node", "staying", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_refusal(pre: dict[str, Any], node: str, staying: list[pf.Placed], want: str | None) -> None:
    assert pf.refusal(pre, NODES[node], NODES, staying, ns_labels) == want


def without(staying: list[pf.Placed], *keys: str) -> list[pf.Placed]:
    return [p for p in staying if p.key not in keys]


def test_the_victims_removal_fixes_ports_anti_affinity_and_spread() -> None:
    """Each refused with the victim there, allowed once it is gone."""
    for pre, victim in (
        (pod(containers=[port(8080)]), on("v", "n1", containers=[port(8080)])),
        (pod(affinity=affinity("podAntiAffinity", term("host", WEB))), on("v", "n1", labels=WEB)),
        (pod(labels=WEB), on("v", "n1", affinity=affinity("podAntiAffinity", term("host", WEB)))),
        (pod(labels=WEB, topologySpreadConstraints=[spread("zone", WEB)]), on("v", "n1", labels=WEB)),
    ):
        staying = [victim, on("keep", "n2")]
        assert pf.refusal(pre, NODES["n1"], NODES, staying, ns_labels) is not None, pre
        assert pf.refusal(pre, NODES["n1"], NODES, without(staying, "ns/v"), ns_labels) is None, pre


def test_the_victims_removal_can_break_pod_affinity() -> None:
    """The pod the preemptor needs nearby is a victim: with it gone, the node refuses (and the
    chooser's prefilter, every pod staying, would have allowed it)."""
    pre = pod(affinity=affinity("podAffinity", term("host", WEB)))
    staying = [on("v", "n1", labels=WEB), on("other", "n3", labels=WEB)]
    assert pf.refusal(pre, NODES["n1"], NODES, staying, ns_labels) is None
    assert pf.refusal(pre, NODES["n1"], NODES, without(staying, "ns/v"), ns_labels) == pf.AFFINITY


def test_garbage_in_the_spec_is_no_crash() -> None:
    """A tenant writes any JSON the API accepts, and some it does not: each filter reads it as
    kube-scheduler would refuse it or ignores it, never raises."""
    pre = pod(
        labels=WEB,
        containers=[{"ports": [{"hostPort": "x"}, None, {"hostPort": 10**30}]}, None],
        topologySpreadConstraints=[spread("zone", WEB, skew=10**30, minDomains="many"), None],
        affinity={
            "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [None, {"topologyKey": 5}]}
        },
        tolerations=[None, "x"],
        nodeSelector="zone",
    )
    assert pf.refusal(pre, NODES["n1"], NODES, [on("w", "n1", labels=WEB)], ns_labels) is not None
