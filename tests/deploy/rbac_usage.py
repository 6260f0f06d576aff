"""Which RBAC rules a component's recorded API requests used, and whether the real API server
allows each of those requests for a ServiceAccount.

A request recorded by tests/faultproxy.py is turned into the attributes RBAC authorizes (verb,
API group, resource[/subresource], namespace, name) the way the API server's request-info
resolver does; a rule is "used" when some recorded request falls under it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from kubernetes import client

_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


@dataclass(frozen=True)
class Attrs:
    verb: str
    group: str = ""
    resource: str = ""  # "pods" or "pods/binding"; "" for a non-resource URL
    namespace: str = ""
    name: str = ""
    path: str = ""  # non-resource URL

    def __str__(self) -> str:
        if not self.resource:
            return f"{self.verb} {self.path}"
        where = f" in {self.namespace}" if self.namespace else ""
        return (
            f"{self.verb} {self.group or 'core'}/{self.resource}{'/' + self.name if self.name else ''}{where}"
        )


def attrs(method: str, path: str, query: dict[str, list[str]]) -> Attrs:
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return Attrs(verb=method.lower(), path=path)
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else ""
    if len(rest) > 2:
        resource += "/" + rest[2]
    if method == "GET":
        watch = query.get("watch", [""])[0] in ("true", "1")
        verb = "get" if name else ("watch" if watch else "list")
        if not name:
            # as the API server does: a list/watch of one name is authorized against that name
            for sel in query.get("fieldSelector", [""])[0].split(","):
                if sel.startswith("metadata.name="):
                    name = sel.removeprefix("metadata.name=")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS[method]
    return Attrs(verb, group, resource, namespace, name)


def covers(rule: dict[str, Any], a: Attrs, role_namespace: str = "") -> bool:
    """The RBAC decision for one rule (a Role's rules apply in its namespace only)."""
    if not a.resource or (role_namespace and a.namespace != role_namespace):
        return False

    def has(values: list[str] | None, v: str) -> bool:
        return bool(values) and ("*" in values or v in values)

    if not (has(rule.get("apiGroups"), a.group) and has(rule.get("resources"), a.resource)):
        return False
    if not has(rule.get("verbs"), a.verb):
        return False
    names = rule.get("resourceNames") or []
    return not names or a.name in names


def permissions(rule: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Every (group, resource, verb, resourceName) a rule grants, one by one."""
    names = rule.get("resourceNames") or [""]
    return list(itertools.product(rule["apiGroups"], rule["resources"], rule["verbs"], names))


def unused(rules: list[dict[str, Any]], seen: set[Attrs], role_namespace: str = "") -> list[str]:
    """The permissions of `rules` that no request in `seen` needed."""
    out = []
    for rule in rules:
        for g, r, v, n in permissions(rule):
            one = {"apiGroups": [g], "resources": [r], "verbs": [v], **({"resourceNames": [n]} if n else {})}
            if not any(covers(one, a, role_namespace) for a in seen):
                out.append(f"{v} {g or 'core'}/{r}{'/' + n if n else ''}")
    return out


def denied(api: client.ApiClient, user: str, seen: set[Attrs]) -> list[str]:
    """The requests in `seen` that the real API server's authorizer refuses for `user`."""
    authz = client.AuthorizationV1Api(api)
    out = []
    for a in sorted(seen, key=str):
        if a.resource:
            res, _, sub = a.resource.partition("/")
            spec: dict[str, Any] = {"resourceAttributes": {
                "verb": a.verb, "group": a.group, "resource": res, "subresource": sub,
                "namespace": a.namespace, "name": a.name,
            }}  # fmt: skip
        else:
            spec = {"nonResourceAttributes": {"verb": a.verb, "path": a.path}}
        spec["user"] = user
        spec["groups"] = ["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}",
                          "system:authenticated"]  # fmt: skip
        r = authz.create_subject_access_review({"spec": spec})
        if not r.status.allowed:
            out.append(str(a))
    return out


def seen_by(proxy: Any) -> set[Attrs]:
    return {attrs(r.method, r.path, r.query) for r in proxy.requests}
