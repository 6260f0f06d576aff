"""The API semantics on top of the store: create/update/patch/delete, subresources, PDBs.

Every public method takes the store lock itself, so a read-check-write (optimistic concurrency,
binding, eviction against a PodDisruptionBudget) is atomic, like a guaranteed update in etcd.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from . import errors, patches, validation
from .errors import ApiError, status_object
from .resources import BY_KEY, Resource
from .selectors import labels_match, selector_from_object
from .store import Obj, Store

PODS = BY_KEY["pods"]
NAMESPACES = BY_KEY["namespaces"]
PDBS = BY_KEY["poddisruptionbudgets.policy"]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

_SYSTEM_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what the real generateName uses
# Resources the garbage collector would clean up after when their owner goes (see delete()).
_OWNERS_WITH_DEPENDENTS = {"replicasets.apps": ("pods",), "deployments.apps": ("replicasets.apps",)}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clone(obj: Any) -> Any:
    # A JSON round trip is faster than copy.deepcopy for these plain trees.
    return json.loads(json.dumps(obj))


def _pod_ready(pod: Obj) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _scaled(value: Any, total: int) -> int:
    """intstr.GetScaledValueFromIntOrPercent with rounding up, as the disruption controller uses."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


class Registry:
    def __init__(self, store: Store, require_namespaces: bool = True) -> None:
        self.store = store
        self.require_namespaces = require_namespaces

    # --- reads --------------------------------------------------------------------------------

    def get(self, res: Resource, ns: str, name: str) -> Obj:
        with self.store.cond:
            obj = self.store.get(res, ns, name)
        if obj is None:
            raise errors.not_found(res.group, res.plural, name)
        return obj

    def list(
        self,
        res: Resource,
        ns: str | None,
        matches: Callable[[Obj], bool] | None,
        index_hint: tuple[str, str] | None = None,
        limit: int = 0,
        continue_token: str | None = None,
    ) -> tuple[list[Obj], list[bytes], int, str | None, int | None]:
        """Matching objects, sorted as etcd returns them, with their JSON; plus the list metadata."""
        with self.store.cond:
            items = None
            if index_hint is not None:
                items = self.store.items_by_field(res, index_hint[0], index_hint[1], ns)
            if items is None:
                items = self.store.items(res, ns)
            if matches is not None:
                items = [o for o in items if matches(o)]
            # etcd returns keys in order: namespace, then name.
            items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
            raws = self.store.raw_items(res, items)
            rv = self.store.rv
        token = None
        remaining = None
        if continue_token:
            try:
                start = tuple(json.loads(base64.urlsafe_b64decode(continue_token.encode()))["start"])
            except (ValueError, KeyError, TypeError):
                raise errors.bad_request("continue key is not valid: illegal base64 data") from None
            keep = [
                i
                for i, o in enumerate(items)
                if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start
            ]
            items = [items[i] for i in keep]
            raws = [raws[i] for i in keep]
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            remaining = len(items) - limit
            items, raws = items[:limit], raws[:limit]
            token = base64.urlsafe_b64encode(
                json.dumps({"rv": rv, "start": [last.get("namespace", ""), last["name"]]}).encode()
            ).decode()
        return items, raws, rv, token, remaining

    # --- create -------------------------------------------------------------------------------

    def create(self, res: Resource, ns: str, body: Any, dry_run: bool = False) -> Obj:
        if not isinstance(body, dict):
            raise errors.bad_request(f"the body of the request must be a {res.kind} object")
        if body.get("kind") not in (None, "", res.kind):
            raise errors.bad_request(
                f'{body.get("kind")} in version "{res.version}" cannot be handled as a {res.kind}'
            )
        meta = body.get("metadata")
        if meta is None:
            meta = body["metadata"] = {}
        if not isinstance(meta, dict):
            raise errors.bad_request("metadata must be an object")
        if res.namespaced:
            if meta.get("namespace") not in (None, "", ns):
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        body["kind"], body["apiVersion"] = res.kind, res.api_version
        for key in _SYSTEM_META + ("resourceVersion", "selfLink"):
            meta.pop(key, None)
        with self.store.cond:
            name = meta.get("name")
            if not name:
                prefix = meta.get("generateName")
                if not prefix:
                    raise errors.invalid(
                        res.group,
                        res.kind,
                        "",
                        [("metadata.name", "Required value: name or generateName is required")],
                    )
                for _ in range(100):
                    name = prefix + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
                    if self.store.get(res, ns, name) is None:
                        break
                meta["name"] = name
            problems = validation.name_errors(name, dns_label=res is NAMESPACES) + validation.metadata_errors(
                meta
            )
            if res.namespaced and self.require_namespaces:
                ns_obj = self.store.get(NAMESPACES, "", ns)
                if ns_obj is None:
                    raise errors.not_found("", "namespaces", ns)
                if ns_obj["metadata"].get("deletionTimestamp"):
                    raise ApiError(
                        403,
                        f'{res.plural} "{name}" is forbidden: unable to create new content in namespace {ns} '
                        "because it is being terminated",
                        "Forbidden",
                    )
            if self.store.get(res, ns, name) is not None:
                raise errors.already_exists(res.group, res.plural, name)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now()
            if res.tracks_generation:
                meta["generation"] = 1
            problems += self._prepare_create(res, body)
            if problems:
                raise errors.invalid(res.group, res.kind, name, problems)
            if dry_run:
                meta["resourceVersion"] = str(self.store.rv)
                return body
            return self.store.put(res, body, None)

    def _prepare_create(self, res: Resource, obj: Obj) -> list[tuple[str, str]]:
        key = res.key
        if key == "pods":
            spec = obj.get("spec")
            if not isinstance(spec, dict):
                return [("spec", "Required value")]
            problems = validation.default_and_validate_pod_spec(spec)
            spec.setdefault("schedulerName", "default-scheduler")
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("dnsPolicy", "ClusterFirst")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("priority", 0)
            spec.setdefault("enableServiceLinks", True)
            spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
            # PrepareForCreate discards client-supplied status: only the kubelet sets it, via pods/status.
            obj["status"] = {"phase": "Pending", "qosClass": validation.qos_class(spec)}
            return problems
        if key == "namespaces":
            obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        elif key == "poddisruptionbudgets.policy":
            obj["status"] = {
                "disruptionsAllowed": 0,
                "currentHealthy": 0,
                "desiredHealthy": 0,
                "expectedPods": 0,
            }
        elif key == "replicasets.apps":
            obj["status"] = {"replicas": 0}
        elif key == "deployments.apps":
            obj["status"] = {}
        return []

    # --- update / patch -----------------------------------------------------------------------

    def update(
        self, res: Resource, ns: str, name: str, body: Any, sub: str | None = None, dry_run: bool = False
    ) -> Obj:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise errors.bad_request(f"the body of the request must be a {res.kind} object")
        if body.get("kind") not in (None, "", res.kind):
            raise errors.bad_request(
                f'{body.get("kind")} in version "{res.version}" cannot be handled as a {res.kind}'
            )
        body_name = (body.get("metadata") or {}).get("name")
        if body_name not in (None, "", name):
            raise errors.bad_request(
                f"the name of the object ({body_name}) does not match the name on the URL ({name})"
            )
        with self.store.cond:
            current = self.store.get(res, ns, name)
            if current is None:
                raise errors.not_found(res.group, res.plural, name)
            return self._commit(res, current, body, sub, dry_run)

    def patch(
        self,
        res: Resource,
        ns: str,
        name: str,
        patch: Any,
        content_type: str,
        sub: str | None = None,
        dry_run: bool = False,
    ) -> Obj:
        if content_type not in (MERGE_PATCH, STRATEGIC_PATCH, JSON_PATCH):
            raise ApiError(
                415,
                f"the body of the request was in an unknown format - accepted media types include: "
                f"{JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_PATCH}",
                "UnsupportedMediaType",
            )
        with self.store.cond:
            current = self.store.get(res, ns, name)
            if current is None:
                raise errors.not_found(res.group, res.plural, name)
            doc = clone(current)
            if content_type == JSON_PATCH:
                patched = patches.json_patch(doc, patch)
            elif content_type == MERGE_PATCH:
                if not isinstance(patch, dict):
                    raise errors.bad_request("merge patch body must be a JSON object")
                patched = patches.merge_patch(doc, patch)
            else:
                patched = patches.strategic_merge_patch(doc, patch)
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata", {}), dict):
                raise errors.invalid(
                    res.group, res.kind, name, [("metadata", "Invalid value: must be an object")]
                )
            meta = patched.setdefault("metadata", {})
            if meta.get("name") != name:
                raise errors.bad_request(
                    f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
                )
            # A resourceVersion the patch left in place is the current one; one it set is a precondition.
            return self._commit(res, current, patched, sub, dry_run)

    def _commit(self, res: Resource, current: Obj, new: Obj, sub: str | None, dry_run: bool) -> Obj:
        cur_meta = current["metadata"]
        name = cur_meta["name"]
        meta = new.get("metadata")
        if meta is None:
            meta = new["metadata"] = {}
        want_rv = meta.get("resourceVersion")
        if want_rv not in (None, "") and want_rv != cur_meta["resourceVersion"]:
            raise errors.conflict(res.group, res.plural, name, errors.STALE)
        want_uid = meta.get("uid")
        if want_uid not in (None, "") and want_uid != cur_meta["uid"]:
            raise errors.conflict(
                res.group,
                res.plural,
                name,
                f"Precondition failed: UID in precondition: {want_uid}, UID in object meta: {cur_meta['uid']}",
            )
        if res.namespaced and meta.get("namespace") not in (None, "", cur_meta.get("namespace")):
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        if sub == "status":
            # The status subresource changes .status only (ResetObjectMetaForStatus + spec copy).
            status = new.get("status")
            new = {k: v for k, v in current.items() if k != "status"}
            if status is not None:
                new["status"] = status
            new["metadata"] = dict(cur_meta)
        else:
            for key in _SYSTEM_META:
                if key in cur_meta:
                    meta[key] = cur_meta[key]
                else:
                    meta.pop(key, None)
            meta["name"] = name
            if res.namespaced:
                meta["namespace"] = cur_meta["namespace"]
            else:
                meta.pop("namespace", None)
            new["kind"], new["apiVersion"] = res.kind, res.api_version
            if res.has_status:
                if "status" in current:
                    new["status"] = current["status"]
                else:
                    new.pop("status", None)
            problems = validation.metadata_errors(meta)
            if res is PODS:
                spec = new.get("spec")
                if not isinstance(spec, dict) or validation.mutable_pod_spec_view(
                    spec
                ) != validation.mutable_pod_spec_view(current.get("spec") or {}):
                    problems.append(
                        (
                            "spec",
                            "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                            "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
                            "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
                            "(allow it to be set to 1 if it was previously negative)",
                        )
                    )
            if res.tracks_generation and new.get("spec") != current.get("spec"):
                meta["generation"] = cur_meta.get("generation", 1) + 1
            if problems:
                raise errors.invalid(res.group, res.kind, name, problems)
        new["metadata"]["resourceVersion"] = cur_meta["resourceVersion"]
        if new == current:
            return current  # a no-op write does not bump resourceVersion or notify watchers
        if dry_run:
            return new
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return self.store.remove(res, current)
        return self.store.put(res, new, current)

    # --- delete -------------------------------------------------------------------------------

    def delete(
        self, res: Resource, ns: str, name: str, options: Any = None, dry_run: bool = False
    ) -> tuple[int, Obj]:
        options = options if isinstance(options, dict) else {}
        dry_run = dry_run or bool(options.get("dryRun"))
        with self.store.cond:
            obj = self.store.get(res, ns, name)
            if obj is None:
                raise errors.not_found(res.group, res.plural, name)
            self._check_preconditions(res, obj, options.get("preconditions") or {})
            if dry_run:
                return 200, obj
            meta = obj["metadata"]
            if meta.get("finalizers") and res is not NAMESPACES:
                if meta.get("deletionTimestamp"):
                    return 200, obj
                marked = clone(obj)
                marked["metadata"]["deletionTimestamp"] = now()
                marked["metadata"]["deletionGracePeriodSeconds"] = 0
                return 200, self.store.put(res, marked, obj)
            if res is NAMESPACES:
                self._delete_namespace_contents(name)
            elif options.get("propagationPolicy") != "Orphan" and res.key in _OWNERS_WITH_DEPENDENTS:
                self._delete_dependents(res, obj)
            gone = self.store.remove(res, obj)
        if res in (PODS, NAMESPACES):
            return 200, gone
        details = {"name": name, "kind": res.plural, "uid": meta["uid"]}
        if res.group:
            details["group"] = res.group
        return 200, status_object(200, "Success", details=details)

    def _check_preconditions(self, res: Resource, obj: Obj, pre: dict[str, Any]) -> None:
        meta = obj["metadata"]
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise errors.conflict(
                res.group, res.plural, meta["name"],
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}",
            )  # fmt: skip
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise errors.conflict(
                res.group, res.plural, meta["name"],
                f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                f"ResourceVersion in object meta: {meta['resourceVersion']}",
            )  # fmt: skip

    def _delete_namespace_contents(self, ns: str) -> None:
        for rs in self.store.resources.values():
            if rs.resource.namespaced:
                for obj in list(rs.objects.get(ns, {}).values()):
                    self.store.remove(rs.resource, obj)

    def _delete_dependents(self, owner_res: Resource, owner: Obj) -> None:
        uid = owner["metadata"]["uid"]
        ns = owner["metadata"].get("namespace")
        for key in _OWNERS_WITH_DEPENDENTS[owner_res.key]:
            dep_res = BY_KEY[key]
            for obj in self.store.items(dep_res, ns):
                if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                    if dep_res.key in _OWNERS_WITH_DEPENDENTS:
                        self._delete_dependents(dep_res, obj)
                    self.store.remove(dep_res, obj)

    def delete_collection(
        self, res: Resource, ns: str | None, matches: Callable[[Obj], bool] | None, options: Any = None
    ) -> list[Obj]:
        with self.store.cond:
            victims = [o for o in self.store.items(res, ns) if matches is None or matches(o)]
            gone = []
            for obj in victims:
                meta = obj["metadata"]
                try:
                    _, out = self.delete(res, meta.get("namespace", ""), meta["name"], options)
                except ApiError:
                    continue
                gone.append(out if out.get("kind") == res.kind else obj)
            return gone

    # --- pods/binding -------------------------------------------------------------------------

    def bind(self, ns: str, name: str, binding: Any, dry_run: bool = False) -> Obj:
        if not isinstance(binding, dict):
            raise errors.bad_request("the body of the request must be a Binding object")
        meta = binding.get("metadata") or {}
        if meta.get("name") not in (None, "", name):
            raise errors.bad_request("name in URL does not match name in Binding object")
        target = binding.get("target") or {}
        if not target.get("name"):
            raise errors.invalid("", "Binding", name, [("target.name", "Required value")])
        if target.get("kind") not in (None, "", "Node"):
            raise errors.invalid(
                "", "Binding", name, [("target.kind", "Invalid value: must be empty or 'Node'")]
            )
        node = target["name"]
        with self.store.cond:
            pod = self.store.get(PODS, ns, name)
            if pod is None:
                raise errors.not_found("", "pods", name)
            pmeta = pod["metadata"]

            def refuse(why: str) -> ApiError:
                return errors.conflict("", "pods/binding", name, why)

            if meta.get("uid") and meta["uid"] != pmeta["uid"]:
                raise refuse(
                    f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: {pmeta['uid']}"
                )
            if meta.get("resourceVersion") and meta["resourceVersion"] != pmeta["resourceVersion"]:
                raise refuse(errors.STALE)
            if pmeta.get("deletionTimestamp"):
                raise refuse(f"pod {name} is being deleted, cannot be assigned to a host")
            if pod["spec"].get("nodeName"):
                raise refuse(f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
            if pod["spec"].get("schedulingGates"):
                raise refuse(f"pod {name} has non-empty .spec.schedulingGates")
            if dry_run:
                return status_object(201)
            bound = clone(pod)
            bound["spec"]["nodeName"] = node
            if meta.get("annotations"):
                bound["metadata"].setdefault("annotations", {}).update(meta["annotations"])
            status = bound.setdefault("status", {})
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
            conditions.append(
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now()}
            )
            status["conditions"] = conditions
            self.store.put(PODS, bound, pod)
        return status_object(201)

    # --- pods/eviction ------------------------------------------------------------------------

    def pdb_status(self, pdb: Obj) -> dict[str, int]:
        """What the disruption controller would publish for `pdb`, computed from the live pods.

        As upstream: an integer minAvailable counts the matching pods; a percentage or
        maxUnavailable scales against the replicas of the pods' controllers (ReplicaSets and
        Deployments stored here), and a pod without such a controller makes the budget allow
        no disruption (upstream fails the sync and fails safe the same way)."""
        ns = pdb["metadata"]["namespace"]
        spec = pdb.get("spec") or {}
        reqs = selector_from_object(spec.get("selector"))
        pods = (
            []
            if reqs is None
            else [p for p in self.store.items(PODS, ns) if labels_match(reqs, p["metadata"].get("labels"))]
        )
        healthy = sum(1 for p in pods if _pod_ready(p))
        min_available = spec.get("minAvailable")
        if spec.get("maxUnavailable") is None and (min_available is None or isinstance(min_available, int)):
            expected = len(pods)
            desired = int(min_available or 0)
        else:
            scale = self._controller_scale(ns, pods)
            if scale is None:
                return {
                    "disruptionsAllowed": 0,
                    "currentHealthy": healthy,
                    "desiredHealthy": 0,
                    "expectedPods": 0,
                }
            expected = scale
            if spec.get("maxUnavailable") is not None:
                desired = max(0, expected - _scaled(spec["maxUnavailable"], expected))
            else:
                desired = _scaled(min_available, expected)
        return {
            "disruptionsAllowed": max(0, healthy - desired),
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
        }

    def _controller_scale(self, ns: str, pods: list[Obj]) -> int | None:
        total, seen = 0, set()
        for pod in pods:
            ref = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
            owner = self._owner(ns, ref)
            if owner is None:
                return None
            parent = self._owner(
                ns,
                next(
                    (r for r in owner["metadata"].get("ownerReferences") or [] if r.get("controller")), None
                ),
            )
            if parent is not None and parent["kind"] == "Deployment":
                owner = parent
            if owner["metadata"]["uid"] in seen:
                continue
            seen.add(owner["metadata"]["uid"])
            total += int((owner.get("spec") or {}).get("replicas", 1))
        return total

    def _owner(self, ns: str, ref: dict[str, Any] | None) -> Obj | None:
        if ref is None or ref.get("kind") not in ("ReplicaSet", "Deployment"):
            return None
        res = BY_KEY["replicasets.apps" if ref["kind"] == "ReplicaSet" else "deployments.apps"]
        owner = self.store.get(res, ns, ref.get("name", ""))
        return owner if owner is not None and owner["metadata"]["uid"] == ref.get("uid") else None

    def evict(self, ns: str, name: str, eviction: Any) -> Obj:
        if not isinstance(eviction, dict):
            raise errors.bad_request("the body of the request must be an Eviction object")
        emeta = eviction.get("metadata") or {}
        if emeta.get("name") not in (None, "", name):
            raise errors.bad_request("name in URL does not match name in Eviction object")
        options = eviction.get("deleteOptions") or {}
        with self.store.cond:
            pod = self.store.get(PODS, ns, name)
            if pod is None:
                raise errors.not_found("", "pods", name)
            phase = (pod.get("status") or {}).get("phase")
            if pod["metadata"].get("deletionTimestamp") or phase in ("Succeeded", "Failed", "Pending"):
                self.delete(PODS, ns, name, options)
                return status_object(201)
            labels = pod["metadata"].get("labels")
            pdbs = []
            for pdb in self.store.items(PDBS, ns):
                reqs = selector_from_object((pdb.get("spec") or {}).get("selector"))
                if reqs is not None and labels_match(reqs, labels):
                    pdbs.append(pdb)
            if len(pdbs) > 1:
                raise ApiError(
                    500,
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                )
            if pdbs:
                pdb = pdbs[0]
                st = self.pdb_status(pdb)
                policy = (pdb.get("spec") or {}).get("unhealthyPodEvictionPolicy", "IfHealthyBudget")
                if _pod_ready(pod):
                    blocked = st["disruptionsAllowed"] <= 0
                else:
                    blocked = policy != "AlwaysAllow" and st["currentHealthy"] < st["desiredHealthy"]
                if blocked:
                    raise ApiError(
                        429,
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        "TooManyRequests",
                        {
                            "causes": [
                                {
                                    "reason": "DisruptionBudget",
                                    "message": f"The disruption budget {pdb['metadata']['name']} needs "
                                    f"{st['desiredHealthy']} healthy pods and has {st['currentHealthy']} currently",
                                }
                            ]
                        },
                    )
            self.delete(PODS, ns, name, options)
        return status_object(201)

    def sync_pdb_status(self, ns: str | None = None) -> None:
        """Publish every PDB's status as the disruption controller would (tests call this)."""
        with self.store.cond:
            for pdb in self.store.items(PDBS, ns):
                new = dict(pdb)
                new["status"] = dict(pdb.get("status") or {}, **self.pdb_status(pdb))
                new["status"]["observedGeneration"] = pdb["metadata"].get("generation", 1)
                new["metadata"] = dict(pdb["metadata"])
                if new["status"] != pdb.get("status"):
                    self.store.put(PDBS, new, pdb)
