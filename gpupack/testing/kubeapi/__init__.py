"""A Kubernetes API server that runs inside a test, over real HTTP, for the official client.

    with KubeAPIServer() as server:
        core = kubernetes.client.CoreV1Api(server.api_client())

Test hooks on `KubeAPIServer`:
- `start()/stop()` (or `with`), `url`, `api_client()`; `stop()` then `start()` is an apiserver
  restart on the same port with the same objects (watches are cut, clients must re-watch).
- `fail_next(method, path_regex, status, times=1, reason=, message=, retry_after=)` answers
  matching requests with that Status instead of serving them; `delay(path_regex, seconds,
  method=, times=)` slows them; `clear_faults()`.
- `requests` (snapshot of (method, path, query-dict) records), `count_requests()`,
  `clear_requests()`, `active_watches`; `record_requests=False` for benchmarks.
- `compact()` drops watch history (older resourceVersions then get 410); `history_limit`
  bounds it per resource; `resource_version` is the current global counter.
- Direct access with the same semantics and watch events as HTTP: `get`, `list`, `create`,
  `create_many` (benchmark seeding), `patch`, `set_status` (a kubelet/controller status write),
  `delete`, `sync_pdb_status`. Resources are named "pods", "nodes", "leases", "events" (core),
  "events.events.k8s.io", "poddisruptionbudgets", "replicasets", ...
- `python -m gpupack.testing.kubeapi.bench [--json]` measures it at benchmark scale.

Faithful to kube-apiserver (tests rely on these; a component that ignores them fails):
- URLs, verbs and JSON of core/v1 pods, nodes, namespaces, events, configmaps; events.k8s.io/v1
  events; coordination.k8s.io/v1 leases; policy/v1 poddisruptionbudgets; apps/v1 replicasets and
  deployments; namespaced vs cluster-scoped paths; lists across all namespaces.
- Errors are `Status` objects with the real reasons and messages (NotFound, AlreadyExists, Conflict,
  Invalid, BadRequest, MethodNotAllowed, UnsupportedMediaType, TooManyRequests, Expired...).
- uid, creationTimestamp, generateName, a global resourceVersion counter; optimistic concurrency:
  a stale resourceVersion in PUT or inside a patch is 409 Conflict; a no-op write changes nothing.
- Status subresources: writes to the main resource ignore .status, writes to /status touch only
  .status; pod create discards the client's status (phase Pending); pod spec is immutable except
  image/tolerations/activeDeadlineSeconds, so spec.nodeName can only be set by pods/binding.
- pods/binding: 409 if already bound or being deleted, uid/resourceVersion preconditions, binding
  annotations copied onto the pod, PodScheduled condition; answers a `Status` (201) as the real
  server does (the official client's create_namespaced_pod_binding then fails to deserialise it
  into V1Binding: call it with `_preload_content=False`, as against a real cluster).
- pods/eviction with PodDisruptionBudgets: 429 TooManyRequests "Cannot evict pod as it would violate
  the pod's disruption budget." when no disruption is allowed; terminal or Pending pods are
  evicted freely; more than one matching PDB is a 500, as upstream.
- Label selectors (=, ==, !=, in, notin, exists, !key) and field selectors (per-resource field
  labels, unsupported ones are 400); lists sorted by namespace/name with limit/continue.
- Watch: chunked newline-delimited events from a resourceVersion, synthetic ADDED for rv ""/"0",
  selector transitions reported as ADDED/DELETED, BOOKMARKs when allowed, and a single ERROR event
  with a 410 Expired Status when the requested resourceVersion was compacted (`compact()`, or the
  per-resource history limit). Watches end cleanly on timeoutSeconds and on `stop()`.
- Validation that bites in practice: DNS names, label keys/values, 256 KiB of annotations,
  extended resources must be integers with requests == limits (requests default to limits),
  namespace must exist (unless `require_namespaces=False`), 3 MiB request bodies (413).
- Finalizers: delete marks deletionTimestamp and the object goes when the last finalizer does.

Simplified (documented, deliberate):
- Strategic merge patch merges lists by key only for the well-known fields in
  `patches.MERGE_KEYS` (conditions, containers, env, ports, volumes, ownerReferences,
  finalizers...); every other list is replaced whole.
- Pods are deleted immediately: gracePeriodSeconds is ignored (no kubelet to confirm).
- Namespace deletion removes its contents at once (no Terminating phase visible).
- Garbage collection only cascades deployments -> replicasets -> pods (foreground or background
  alike, synchronously); `propagationPolicy: Orphan` is honoured.
- PDB: expected pods are the matching non-terminal pods, not the controller's scale; status is
  computed live at eviction time; `sync_pdb_status()` publishes it on the PDB objects.
- core/v1 and events.k8s.io/v1 events are stored separately; no server-side apply (415), no
  protobuf, no authn/authz, no admission webhooks, no managedFields, no event TTL.
"""

from .errors import ApiError
from .server import KubeAPIServer, RequestRecord

__all__ = ["ApiError", "KubeAPIServer", "RequestRecord"]
