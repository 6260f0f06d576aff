"""The resource types the in-test API server serves, and how their URLs map onto them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    # Fields the real server accepts in fieldSelector beyond metadata.name/metadata.namespace.
    field_labels: tuple[str, ...] = ()
    # metadata.generation is tracked (bumped on spec changes) like apps/policy types do.
    tracks_generation: bool = False
    short_names: tuple[str, ...] = field(default=())

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """`plural` for the core group, `plural.group` otherwise (as kubectl spells it)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


_POD_FIELDS = (
    "spec.nodeName",
    "spec.schedulerName",
    "spec.restartPolicy",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)
_CORE_EVENT_FIELDS = (
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)
_EVENTS_V1_FIELDS = (
    "regarding.kind",
    "regarding.namespace",
    "regarding.name",
    "regarding.uid",
    "regarding.apiVersion",
    "regarding.resourceVersion",
    "regarding.fieldPath",
    "reason",
    "reportingController",
    "type",
)

RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "pods", "Pod", True, frozenset({"status", "binding", "eviction"}), _POD_FIELDS),
    Resource("", "v1", "nodes", "Node", False, frozenset({"status"}), ("spec.unschedulable",)),
    Resource(
        "", "v1", "namespaces", "Namespace", False, frozenset({"status", "finalize"}), ("status.phase",)
    ),
    Resource("", "v1", "events", "Event", True, frozenset(), _CORE_EVENT_FIELDS),
    Resource("", "v1", "configmaps", "ConfigMap", True),
    Resource("events.k8s.io", "v1", "events", "Event", True, frozenset(), _EVENTS_V1_FIELDS),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
    Resource(
        "policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, frozenset({"status"}), (), True
    ),
    Resource(
        "apps", "v1", "replicasets", "ReplicaSet", True, frozenset({"status"}), ("status.replicas",), True
    ),
    Resource("apps", "v1", "deployments", "Deployment", True, frozenset({"status"}), (), True),
)

BY_PATH: dict[tuple[str, str, str], Resource] = {(r.group, r.version, r.plural): r for r in RESOURCES}
BY_KEY: dict[str, Resource] = {r.key: r for r in RESOURCES}


def lookup(name: str) -> Resource:
    """Resolve "pods", "leases", "leases.coordination.k8s.io", "events.events.k8s.io", or a Kind."""
    if name in BY_KEY:
        return BY_KEY[name]
    matches = [r for r in RESOURCES if name in (r.plural, r.kind, r.kind.lower())]
    core = [r for r in matches if not r.group]
    if len(matches) == 1 or core:
        return (core or matches)[0]
    raise KeyError(f"unknown resource {name!r}; known: {sorted(BY_KEY)}")
