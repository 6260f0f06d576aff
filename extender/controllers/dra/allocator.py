"""The writes: a claim's allocation, and the pod's gate taken off once all its claims are allocated.

A claim is written as kube-scheduler writes one it allocates: first the `delete-protection`
finalizer (so the ResourceClaim controller deallocates it, and only it, once no pod reserves it),
then `status.allocation` (results with consumedCapacity and a fresh shareID per result, the node
selector of the chosen node) with `reservedFor` the pod, in one status update guarded by the
resourceVersion read: if anything wrote the claim since (another allocator, a restarted one), the
update fails with a conflict and nothing is booked twice. kube-scheduler then finds the claim
allocated, filters every other node out by the node selector, and binds the pod there.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from kubernetes import client

from .claims import FINALIZER, GATE
from .placement import Chosen

PIN_ANNOTATION = "gpupack.io/dra-pinned-node"


def _json(resp: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(resp.data)
    return out


class Writer:
    def __init__(self, api: client.ApiClient, timeout_s: float = 10.0) -> None:
        self.core, self.res = client.CoreV1Api(api), client.ResourceV1Api(api)
        self.timeout_s = timeout_s

    def allocate(
        self, claim: dict[str, Any], results: list[dict[str, Any]], node: str, pod: dict[str, Any]
    ) -> dict[str, Any]:
        """The claim allocated (its new state); ApiException (409 when it changed) otherwise."""
        meta = claim["metadata"]
        ns, name = meta["namespace"], meta["name"]
        if FINALIZER not in (meta.get("finalizers") or []):
            body = copy.deepcopy(claim)
            body["metadata"]["finalizers"] = [*(meta.get("finalizers") or []), FINALIZER]
            claim = _json(self.res.replace_namespaced_resource_claim(
                name, ns, body, _preload_content=False, _request_timeout=self.timeout_s))  # fmt: skip
        body = copy.deepcopy(claim)
        pm = pod["metadata"]
        body["status"] = {
            **(claim.get("status") or {}),
            "allocation": {
                "devices": {"results": [{**r, "shareID": str(uuid.uuid4())} for r in results]},
                "nodeSelector": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]},
            },
            "reservedFor": [{"resource": "pods", "name": pm["name"], "uid": pm["uid"]}],
        }  # fmt: skip
        return _json(self.res.replace_namespaced_resource_claim_status(
            name, ns, body, _preload_content=False, _request_timeout=self.timeout_s))  # fmt: skip

    def ungate(self, pod: dict[str, Any], pin: str | None = None) -> dict[str, Any]:
        """The pod without this controller's gate (other gates kept); a conflict (409/422) when
        the gates changed since read. `pin`: a node the pod must go to, written in the same patch
        as a required node affinity (a gated pod's affinity may be added, Kubernetes 1.30+) and
        the annotation PIN_ANNOTATION (so the allocator counts its CPU there until it is bound);
        only for a pod with no required node affinity of its own (the caller checks)."""
        spec = pod.get("spec") or {}
        gates = spec.get("schedulingGates") or []
        rest = [g for g in gates if (g or {}).get("name") != GATE]
        ops: list[dict[str, Any]] = [{"op": "test", "path": "/spec/schedulingGates", "value": gates}]
        if pin is not None:
            term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pin]}]}
            required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
            affinity = spec.get("affinity")
            if affinity is None:
                ops.append({"op": "add", "path": "/spec/affinity", "value": {"nodeAffinity": required}})
            elif affinity.get("nodeAffinity") is None:
                ops.append({"op": "add", "path": "/spec/affinity/nodeAffinity", "value": required})
            else:
                ops.append({"op": "add", "path": "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution",
                            "value": required["requiredDuringSchedulingIgnoredDuringExecution"]})  # fmt: skip
            if not (pod.get("metadata") or {}).get("annotations"):
                ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
            ops.append(
                {
                    "op": "add",
                    "path": "/metadata/annotations/" + PIN_ANNOTATION.replace("/", "~1"),
                    "value": pin,
                }
            )
        ops.append({"op": "replace", "path": "/spec/schedulingGates", "value": rest} if rest
                   else {"op": "remove", "path": "/spec/schedulingGates"})  # fmt: skip
        m = pod["metadata"]
        return _json(self.core.patch_namespaced_pod(
            m["name"], m["namespace"], ops, _preload_content=False, _request_timeout=self.timeout_s))  # fmt: skip


def placed_node(claim: dict[str, Any]) -> str | None:
    """The node an allocated claim is bound to (its nodeSelector's one metadata.name), else None."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    for term in (alloc.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for f in (term or {}).get("matchFields") or []:
            vals = (f or {}).get("values") or []
            if (f or {}).get("key") == "metadata.name" and f.get("operator") == "In" and len(vals) == 1:
                return str(vals[0])
    return None


__all__ = ["Chosen", "Writer", "placed_node"]
