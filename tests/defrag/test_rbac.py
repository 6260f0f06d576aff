"""deploy/defrag's RBAC is exactly what `gpupack defrag --apply` calls.

The manifests are applied to the real API server (namespace mapped to the test's), and runs use a
real token of the `gpupack-defrag` ServiceAccount: a missing permission is a 403 from the real
RBAC authorizer (the run fails, or a best-effort write logs it). The runs go through the fault
proxy, which records every request: each must be allowed by a rule, and every rule must be used.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import yaml
from defrag_cluster import Fleet
from kubernetes import client
from realk8s import until
from test_defrag_cli import seed

from extender.controllers.defrag.cli import main

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "defrag"
RBAC = DEPLOY / "rbac.yaml"
SA = "gpupack-defrag"
PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<res>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def to_rbac(method: str, path: str, query: dict) -> tuple[str, str, str, str, str]:
    """(apiGroup, resource[/subresource], verb, namespace, name) as the RBAC authorizer sees it."""
    m = PATH.match(path)
    assert m, path
    group, ns, res = m.group("group") or "", m.group("ns") or "", m.group("res")
    name, sub = m.group("name"), m.group("sub")
    resource = f"{res}/{sub}" if sub else res
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
    if verb is None:
        watching = any(v.lower() in ("true", "1") for v in query.get("watch", []))
        verb = "watch" if watching else ("get" if name else "list")
    if method == "POST" and not sub:
        name = ""  # a create names no object yet (resourceNames cannot restrict it)
    return group, resource, verb, ns, name or ""


Key = tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def rule_key(scope: str, rule: dict) -> Key:
    return scope, tuple(rule["apiGroups"]), tuple(rule["resources"]), tuple(rule.get("resourceNames", ()))


def allowed(rules: list[tuple[str, dict]], req: tuple[str, str, str, str, str]) -> Key | None:
    group, resource, verb, ns, name = req
    for scope, rule in rules:
        if scope and scope != ns:
            continue
        if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
            names = rule.get("resourceNames")
            if names and name not in names:
                continue
            return rule_key(scope, rule)
    return None


def manifests(namespace: str) -> list[dict]:
    """deploy/defrag's ServiceAccount and RBAC, moved from gpupack-system to `namespace`."""
    docs = []
    for f in (DEPLOY / "serviceaccount.yaml", RBAC):
        text = f.read_text().replace("namespace: gpupack-system", f"namespace: {namespace}")
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def wait_authorized(fleet: Fleet, ns: str) -> None:
    """RBAC objects reach the authorizer through its informers: wait until they are in force."""
    authz = client.AuthorizationV1Api(fleet.api)

    def can(verb: str, resource: str, namespace: str = "", group: str = "", name: str = "") -> bool:
        review = authz.create_subject_access_review({
            "spec": {"user": f"system:serviceaccount:{ns}:{SA}",
                     "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}"],
                     "resourceAttributes": {"verb": verb, "resource": resource, "namespace": namespace,
                                            "group": group, "name": name}},
        })  # fmt: skip
        return bool(review.status.allowed)

    until(lambda: can("list", "pods") and can("update", "leases", ns, "coordination.k8s.io", "gpupack-defrag"),
          30, "the defrag RBAC to be in force")  # fmt: skip


def test_rbac_allows_every_call_of_a_run_and_nothing_unused(cluster, fleet, proxy, tmp_path, capsys, caplog):
    s = seed(fleet)
    ns = fleet.lease_ns  # stands for gpupack-system: the ServiceAccount and its Lease live here
    docs = manifests(ns)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    wait_authorized(fleet, ns)
    token = cluster.service_account_token(ns, SA)
    kubeconfig = cluster.write_kubeconfig(tmp_path / "defrag.kubeconfig", token=token, server=proxy.url)
    base = ["--kubeconfig", str(kubeconfig), "--lease-namespace", ns]

    caplog.set_level(logging.WARNING)
    assert main(base) == 0  # dry run
    assert "2 eviction(s)" in capsys.readouterr().out
    # Nobody schedules the replacement: the run reserves, evicts, waits, gives up, cleans up.
    assert main([*base, "--apply", "--move-timeout", "0.5", "--poll-interval", "0.05"]) == 1
    assert main([*base, "--apply", "--max-evictions", "0"]) == 0  # the Lease exists now: get + update
    err = capsys.readouterr().err
    assert "API error" not in err, err
    # Best-effort writes (events, reservation removal, lease release) only log a refusal: none may.
    refused = [
        r.getMessage() for r in caplog.records if "403" in r.getMessage() or "Forbidden" in r.getMessage()
    ]
    assert refused == []
    assert fleet.pods(s.ns)[f"{s.ns}/{s.w1}"]["metadata"].get("deletionTimestamp"), (
        "the eviction went through"
    )
    reasons = {e["reason"] for e in fleet.defrag_events(s.ns)}
    assert {"DefragEvicted", "DefragAborted"} <= reasons, "events on the pod and on the node were written"
    lease = fleet.lease()
    assert lease is not None and not lease["spec"].get("holderIdentity"), "the lease was created and released"

    rules: list[tuple[str, dict]] = []
    for d in docs:
        if d["kind"] == "ClusterRole":
            rules += [("", r) for r in d["rules"]]
        elif d["kind"] == "Role":
            rules += [(d["metadata"]["namespace"], r) for r in d["rules"]]
    subject = [{"kind": "ServiceAccount", "name": SA, "namespace": ns}]
    bound = {d["roleRef"]["name"] for d in docs if d["kind"].endswith("Binding") and d["subjects"] == subject}
    assert bound == {d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "Role")}
    used = set()
    assert proxy.requests
    for r in proxy.requests:
        req = to_rbac(r.method, r.path, r.query)
        hit = allowed(rules, req)
        assert hit is not None, f"{r.method} {r.path} ({req}) is not allowed by deploy/defrag/rbac.yaml"
        used.add((hit, req[2]))
    for scope, rule in rules:
        for verb in rule["verbs"]:
            assert (rule_key(scope, rule), verb) in used, (
                f"unused RBAC: {verb} {rule['resources']} {scope or 'cluster-wide'}"
            )
