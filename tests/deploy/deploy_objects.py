"""deploy/ manifests loaded for tests against the real API server, moved into a test's namespace.

Tests share one control plane, so each installs gpupack's objects into a namespace of its own:
every `gpupack-system` (object namespaces, RoleBinding subjects, the webhooks' Service) becomes
that namespace. Cluster-scoped names stay as shipped (cluster.reset() removes them after a test).
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SHIPPED_NS = "gpupack-system"


def suffix() -> str:
    return uuid.uuid4().hex[:6]


def load(relpath: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / relpath).read_text()) if d]


def remap(objs: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """A deep copy of `objs` with every `gpupack-system` (also inside strings: flags, DNS names)
    replaced by `namespace`."""
    assert namespace.replace("-", "").isalnum(), namespace
    return json.loads(json.dumps(copy.deepcopy(objs)).replace(SHIPPED_NS, namespace))


def apply(cluster: Any, objs: list[dict[str, Any]]) -> str:
    """Server-side apply as the admin (what `kubectl apply --server-side` of the manifest does)."""
    text = yaml.safe_dump_all(objs)
    return cluster.kubectl("apply", "--server-side", "--field-manager=gpupack-test", "-f", "-", input=text)


def container_args(
    relpath: str, container: str, namespace: str, env: dict[str, str], drop: tuple[str, ...] = ()
) -> list[str]:
    """A shipped container's args moved into `namespace`, `$(VAR)` filled from `env`, without the
    flags in `drop` (those a test sets itself: ports, file paths inside the image)."""
    for o in remap(load(relpath), namespace):
        if o["kind"] in ("Deployment", "DaemonSet"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                if c["name"] == container:
                    out = []
                    for a in c.get("args") or []:
                        if a.split("=", 1)[0] in drop:
                            continue
                        for k, v in env.items():
                            a = a.replace(f"$({k})", v)
                        assert "$(" not in a, f"{relpath} {container}: no value for {a}"
                        out.append(a)
                    return out
    raise KeyError(f"{relpath} has no container {container}")


POLICIES = (
    "gpupack-pod-state",
    "gpupack-device-plugin-scope",
    "gpupack-scheduler-scope",
    "gpupack-scheduler-node-scope",
    "gpupack-extender-delete-scope",
    "gpupack-defrag-scope",
)


def drop_policies(cluster: Any, timeout: float = 30.0) -> None:
    """Remove deploy/webhook/policies.yaml's objects (and the `gpupack` webhook configurations, whose
    state webhook enforces the same rule) and wait until the API server stops enforcing them (it
    drops a deleted policy a moment later), so the next test may write gpupack state as the admin.
    A server-side dry run goes through admission: it tells without leaving anything."""
    import time

    cluster.kubectl("delete", "mutatingwebhookconfigurations,validatingwebhookconfigurations", "gpupack",
                    "--ignore-not-found")  # fmt: skip
    for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
        cluster.kubectl("delete", kind, *POLICIES, "--ignore-not-found")
    probe = {"metadata": {"name": "policy-probe", "annotations": {"gpupack.io/handoff": "pending"}},
             "spec": {"containers": [{"name": "a", "image": "registry.invalid/x:1"}]}}  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        try:
            cluster.core.create_namespaced_pod("default", probe, dry_run="All")
            return
        except Exception as e:  # an ApiException while the policy is still in force
            if time.monotonic() > deadline:
                raise AssertionError(f"the admission policies are still enforced: {e}") from e
            time.sleep(0.2)


class pod_namespace:
    """`with pod_namespace(ns):` start the extender as the Deployment does, with POD_NAMESPACE (its
    webhook trusts that namespace's ServiceAccounts); child processes inherit the environment."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def __enter__(self) -> None:
        import os

        self.saved = os.environ.get("POD_NAMESPACE")
        os.environ["POD_NAMESPACE"] = self.namespace

    def __exit__(self, *exc: Any) -> None:
        import os

        if self.saved is None:
            os.environ.pop("POD_NAMESPACE", None)
        else:
            os.environ["POD_NAMESPACE"] = self.saved
