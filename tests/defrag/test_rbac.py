"""deploy/defrag's RBAC is exactly what `gpupack defrag --apply` calls: every request a run makes
is allowed by the manifests, and every rule in them is used."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from test_defrag_cli import seed

from extender.defrag.cli import main

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "defrag" / "rbac.yaml"
PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<res>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def to_rbac(method: str, path: str, query: dict) -> tuple[str, str, str, str, str]:
    m = PATH.match(path)
    assert m, path
    group, ns, res, name, sub = m.group("group") or "", m.group("ns") or "", m.group("res"), m.group("name"), m.group("sub")
    resource = f"{res}/{sub}" if sub else res
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
    if verb is None:
        verb = "watch" if str(query.get("watch", "")).lower() in ("true", "1") else ("get" if name else "list")
    if method == "POST" and not sub:
        name = ""  # a create names no object yet (resourceNames cannot restrict it)
    return group, resource, verb, ns, name or ""


def allowed(rules, req) -> tuple | None:
    group, resource, verb, ns, name = req
    for scope, rule in rules:
        if scope and scope != ns:
            continue
        if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
            names = rule.get("resourceNames")
            if names and name not in names:
                continue
            return scope, tuple(rule["apiGroups"]), tuple(rule["resources"]), tuple(rule.get("resourceNames", ()))
    return None


def test_rbac_allows_every_call_of_a_run_and_nothing_unused(cluster, kubeapi, kubeconfig, capsys):
    seed(cluster)
    cluster.stop()  # the controllers' own calls are not defrag's; nothing recreates pods now
    kubeapi.clear_requests()
    assert main(["--kubeconfig", str(kubeconfig)]) == 0  # dry run
    assert main(["--kubeconfig", str(kubeconfig), "--apply", "--move-timeout", "0.5", "--poll-interval", "0.05"]) == 1
    assert main(["--kubeconfig", str(kubeconfig), "--apply", "--max-evictions", "0"]) == 0  # lease exists now
    capsys.readouterr()
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    rules = []
    for d in docs:
        if d["kind"] == "ClusterRole":
            rules += [("", r) for r in d["rules"]]
        elif d["kind"] == "Role":
            rules += [(d["metadata"]["namespace"], r) for r in d["rules"]]
    bound = {d["roleRef"]["name"] for d in docs if d["kind"].endswith("Binding")
             and d["subjects"] == [{"kind": "ServiceAccount", "name": "gpupack-defrag", "namespace": "gpupack-system"}]}
    assert bound == {d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "Role")}
    used = set()
    for r in kubeapi.requests:
        req = to_rbac(r.method, r.path, r.query)
        hit = allowed(rules, req)
        assert hit is not None, f"{r.method} {r.path} ({req}) is not allowed by deploy/defrag/rbac.yaml"
        used.add((hit, req[2]))
    for scope, rule in rules:
        key = (scope, tuple(rule["apiGroups"]), tuple(rule["resources"]), tuple(rule.get("resourceNames", ())))
        for verb in rule["verbs"]:
            assert (key, verb) in used, f"unused RBAC: {verb} {rule['resources']} {scope or 'cluster-wide'}"
