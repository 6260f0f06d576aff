"""kube-scheduler `extender/v1` JSON: parse requests strictly, build responses.

Every parse error is a :class:`WireError` carrying the HTTP status and a reason a person reads;
the HTTP layer turns it into a 4xx. Keys are the Go field names (`Pod`, `NodeNames`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_NODES = 100_000  # more names than any cluster has: a hostile or broken body
MAX_NAME = 253  # DNS subdomain limit for object names


class WireError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class PodRequestError(WireError):
    """A well-formed request about a pod whose GPU request gpupack cannot serve (gpu-sm 150, a
    quantity that is no number, more GPUs than any node has). Filter and prioritize answer it
    with 200 and the reason on every node: a 4xx would reach the user only as the scheduler's
    "failed filter with extender ... code 400", retried forever; an unresolvable node reason
    reaches `kubectl describe pod` as the FailedScheduling event."""


@dataclass(frozen=True)
class ExtenderArgs:
    """A filter or prioritize request."""

    pod: dict[str, Any]
    node_names: list[str]
    # name -> Node object, only when the scheduler sent full Nodes (nodeCacheCapable: false)
    node_objects: dict[str, dict[str, Any]] | None

    @property
    def node_cache_capable(self) -> bool:
        return self.node_objects is None


@dataclass(frozen=True)
class BindArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    @property
    def key(self) -> str:
        return f"{self.pod_namespace}/{self.pod_name}"


def _name(v: Any, what: str, allow_empty: bool = False) -> str:
    if not isinstance(v, str):
        raise WireError(f"{what} must be a string, got {type(v).__name__}")
    if not v and not allow_empty:
        raise WireError(f"{what} must not be empty")
    if len(v) > MAX_NAME:
        raise WireError(f"{what} is {len(v)} characters long; Kubernetes names have at most {MAX_NAME}")
    return v


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise WireError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_extender_args(body: Any) -> ExtenderArgs:
    body = _object(body)
    pod = body.get("Pod")
    if not isinstance(pod, dict):
        raise WireError("field Pod must be a Pod object" if pod is not None else "missing field Pod")
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        raise WireError("Pod.metadata must be an object")
    _name(meta.get("name"), "Pod.metadata.name")
    if meta.get("namespace") is not None:
        _name(meta.get("namespace"), "Pod.metadata.namespace")
    if not isinstance(pod.get("spec"), dict):
        raise WireError("Pod.spec must be an object")

    names_raw = body.get("NodeNames")
    nodes_raw = body.get("Nodes")
    if names_raw is None and nodes_raw is None:
        raise WireError("one of NodeNames (nodeCacheCapable: true) or Nodes must be set")
    if names_raw is not None:
        if not isinstance(names_raw, list):
            raise WireError(f"NodeNames must be a list of strings, got {type(names_raw).__name__}")
        if len(names_raw) > MAX_NODES:
            raise WireError(f"NodeNames lists {len(names_raw)} nodes; at most {MAX_NODES} are accepted")
        # C-speed check for the common all-good case; the slow path names the bad entry
        if names_raw and (
            set(map(type, names_raw)) != {str}
            or min(map(len, names_raw)) == 0
            or max(map(len, names_raw)) > MAX_NAME
        ):
            for i, n in enumerate(names_raw):
                _name(n, f"NodeNames[{i}]")
        return ExtenderArgs(pod, names_raw, None)
    if not isinstance(nodes_raw, dict) or not isinstance(nodes_raw.get("items"), list):
        raise WireError("Nodes must be a NodeList object with an items list")
    items = nodes_raw["items"]
    if len(items) > MAX_NODES:
        raise WireError(f"Nodes lists {len(items)} nodes; at most {MAX_NODES} are accepted")
    objects: dict[str, dict[str, Any]] = {}
    for i, n in enumerate(items):
        if not isinstance(n, dict) or not isinstance(n.get("metadata"), dict):
            raise WireError(f"Nodes.items[{i}] must be a Node object with metadata")
        objects[_name(n["metadata"].get("name"), f"Nodes.items[{i}].metadata.name")] = n
    return ExtenderArgs(pod, list(objects), objects)


def parse_bind_args(body: Any) -> BindArgs:
    body = _object(body)
    for key in ("PodName", "PodNamespace", "Node"):
        if key not in body:
            raise WireError(f"missing field {key}")
    return BindArgs(
        pod_name=_name(body["PodName"], "PodName"),
        pod_namespace=_name(body["PodNamespace"], "PodNamespace"),
        pod_uid=_name(body.get("PodUID", ""), "PodUID", allow_empty=True),
        node=_name(body["Node"], "Node"),
    )


def filter_result(
    args: ExtenderArgs,
    passed: list[str],
    failed: dict[str, str],
    unresolvable: dict[str, str],
    error: str = "",
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "NodeNames": passed,
        "FailedNodes": _plain(failed),
        "FailedAndUnresolvableNodes": _plain(unresolvable),
        "Error": error,
    }
    # A scheduler without node cache reads the passing nodes back from Nodes.items.
    out["Nodes"] = (
        None
        if args.node_objects is None
        else {
            "metadata": {},
            "items": [args.node_objects[n] for n in passed],
        }
    )
    return out


def _plain(reasons: dict[str, str]) -> dict[str, str]:
    """kube-scheduler v1.28 passes the reasons on as the format string of its FailedScheduling
    event, so "40% SM" would reach `kubectl describe pod` as "40%!S(MISSING)M"."""
    if not any("%" in r for r in reasons.values()):
        return reasons
    return {n: r.replace("%", " percent") for n, r in reasons.items()}


def unresolvable_result(args: ExtenderArgs, reason: str) -> dict[str, Any]:
    """A filter answer that rejects every node for one reason no preemption or wait can change."""
    return filter_result(args, [], {}, dict.fromkeys(args.node_names, reason))


def priority_result(scores: dict[str, int]) -> list[dict[str, Any]]:
    return [{"Host": h, "Score": s} for h, s in scores.items()]


def bind_result(error: str = "") -> dict[str, str]:
    return {"Error": error}
