"""JSON merge patch (RFC 7386), strategic merge patch, and JSON patch (RFC 6902).

All functions take a private deep copy of the target and may modify it in place.

Strategic merge: maps merge recursively and `null` deletes a key, as in merge patch. Lists merge
by key only where Kubernetes declares `patchStrategy: merge` on a field this server knows about
(`MERGE_KEYS`, e.g. `status.conditions` by `type`, `spec.containers` by `name`,
`metadata.finalizers` as a set); every other list is replaced whole — a simplification of the
real server, which reads the strategy from the Go types of every field. The directives
`$patch: replace|delete` and `$deleteFromPrimitiveList/<field>` are honoured; `$setElementOrder`
and `$retainKeys` are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError, bad_request

_PRIMITIVE_SET = object()

_POD_SPEC_LISTS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
}
_CONTAINER_LISTS = {
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
}


def _build_merge_keys() -> dict[tuple[str, ...], object]:
    keys: dict[tuple[str, ...], object] = {
        ("metadata", "ownerReferences"): "uid",
        ("metadata", "finalizers"): _PRIMITIVE_SET,
        ("status", "conditions"): "type",
        ("status", "addresses"): "type",
        ("spec", "finalizers"): _PRIMITIVE_SET,
    }
    for prefix in (("spec",), ("spec", "template", "spec")):
        for field, key in _POD_SPEC_LISTS.items():
            keys[prefix + (field,)] = key
        for containers in ("containers", "initContainers", "ephemeralContainers"):
            for field, key in _CONTAINER_LISTS.items():
                keys[prefix + (containers, "[]", field)] = key
    keys[("spec", "template", "metadata", "ownerReferences")] = "uid"
    keys[("spec", "template", "metadata", "finalizers")] = _PRIMITIVE_SET
    return keys


MERGE_KEYS = _build_merge_keys()


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = merge_patch(target.get(key), value)
    return target


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        raise bad_request("strategic merge patch body must be a JSON object")
    return _smp_map(target if isinstance(target, dict) else {}, patch, ())


def _smp_map(target: dict[str, Any], patch: dict[str, Any], path: tuple[str, ...]) -> Any:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    if directive is not None:
        raise bad_request(f"Unknown patch type: {directive}")
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(target.get(field), list):
                drop = value if isinstance(value, list) else [value]
                target[field] = [v for v in target[field] if v not in drop]
            continue
        if key.startswith("$setElementOrder/") or key == "$retainKeys":
            continue
        if value is None:
            target.pop(key, None)
            continue
        sub = path + (key,)
        current = target.get(key)
        if isinstance(value, dict):
            merged = _smp_map(current if isinstance(current, dict) else {}, value, sub)
            if merged is None:
                target.pop(key, None)
            else:
                target[key] = merged
        elif isinstance(value, list) and sub in MERGE_KEYS:
            target[key] = _smp_list(current if isinstance(current, list) else [], value, sub, MERGE_KEYS[sub])
        else:
            target[key] = value
    return target


def _smp_list(current: list[Any], patch: list[Any], path: tuple[str, ...], merge_key: object) -> list[Any]:
    if merge_key is _PRIMITIVE_SET:
        out = list(current)
        out.extend(v for v in patch if v not in out)
        return out
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [p for p in patch if not (isinstance(p, dict) and p.get("$patch") == "replace")]
    out = list(current)
    item_path = path + ("[]",)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            out.append(item)
            continue
        idx = next(
            (i for i, e in enumerate(out) if isinstance(e, dict) and e.get(merge_key) == item[merge_key]),
            None,
        )
        if item.get("$patch") == "delete":
            if idx is not None:
                del out[idx]
            continue
        if idx is None:
            merged = _smp_map({}, item, item_path)
            out.append(merged)
        else:
            out[idx] = _smp_map(out[idx], item, item_path)
    return out


# --- JSON patch ------------------------------------------------------------------------------


def _invalid(message: str) -> ApiError:
    return ApiError(422, message, "Invalid")


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise bad_request(f"invalid JSON pointer {path!r}")
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], op: str) -> tuple[Any, str]:
    if not parts:
        raise _invalid(f"{op} operation on the document root is not supported")
    cur = doc
    for part in parts[:-1]:
        cur = _child(cur, part, op)
    return cur, parts[-1]


def _child(cur: Any, part: str, op: str) -> Any:
    if isinstance(cur, dict):
        if part not in cur:
            raise _invalid(f"{op} operation does not apply: doc is missing path: {part}")
        return cur[part]
    if isinstance(cur, list):
        try:
            return cur[_index(cur, part, op, allow_end=False)]
        except IndexError:
            raise _invalid(f"{op} operation does not apply: index out of range: {part}") from None
    raise _invalid(f"{op} operation does not apply: doc is missing path: {part}")


def _index(lst: list[Any], part: str, op: str, allow_end: bool) -> int:
    if part == "-" and allow_end:
        return len(lst)
    if not part.isdigit():
        raise _invalid(f"{op} operation does not apply: invalid array index {part!r}")
    i = int(part)
    if i > len(lst) or (i == len(lst) and not allow_end):
        raise _invalid(f"{op} operation does not apply: index out of range: {part}")
    return i


def _get(doc: Any, parts: list[str], op: str) -> Any:
    cur = doc
    for part in parts:
        cur = _child(cur, part, op)
    return cur


def _add(doc: Any, parts: list[str], value: Any, op: str = "add") -> None:
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, op, allow_end=True), value)
    else:
        raise _invalid(f"{op} operation does not apply: doc is missing path")


def _remove(doc: Any, parts: list[str], op: str = "remove") -> Any:
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict):
        if last not in parent:
            raise _invalid(f"{op} operation does not apply: doc is missing key: /{'/'.join(parts)}")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, op, allow_end=False))
    raise _invalid(f"{op} operation does not apply: doc is missing path")


def json_patch(doc: Any, ops: Any) -> Any:
    import copy

    if not isinstance(ops, list):
        raise bad_request("json patch body must be a JSON array of operations")
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid json patch operation: {op!r}")
        kind, parts = op["op"], _pointer(op["path"])
        if kind in ("add", "replace", "test") and "value" not in op:
            raise bad_request(f"{kind} operation is missing 'value'")
        if kind == "add":
            _add(doc, parts, copy.deepcopy(op["value"]))
        elif kind == "remove":
            _remove(doc, parts)
        elif kind == "replace":
            _remove(doc, parts, "replace")
            _add(doc, parts, copy.deepcopy(op["value"]), "replace")
        elif kind == "move":
            value = _remove(doc, _pointer(op.get("from")), "move")
            _add(doc, parts, value, "move")
        elif kind == "copy":
            _add(doc, parts, copy.deepcopy(_get(doc, _pointer(op.get("from")), "copy")), "copy")
        elif kind == "test":
            if _get(doc, parts, "test") != op["value"]:
                raise _invalid(f"testing value {op['path']} failed: test operation does not apply")
        else:
            raise bad_request(f"Unexpected kind: {kind}")
    return doc
