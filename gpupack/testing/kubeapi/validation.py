"""The subset of apiserver validation that components can trip over in practice."""

from __future__ import annotations

import functools
import re
from decimal import Decimal, InvalidOperation
from typing import Any

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
ANNOTATIONS_MAX_BYTES = 256 * 1024

_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_NATIVE = {"cpu", "memory", "ephemeral-storage", "storage", "pods"}


def parse_quantity(value: Any) -> Decimal | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Decimal(str(value))
    if not isinstance(value, str):
        return None
    return _parse_quantity_text(value)


@functools.lru_cache(maxsize=4096)
def _parse_quantity_text(value: str) -> Decimal | None:
    m = _QUANTITY.match(value.strip())
    if not m:
        return None
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        return None
    suffix = m.group(2)
    if not suffix:
        return number
    if suffix[0] in "eE" and len(suffix) > 1:
        return number * (Decimal(10) ** int(suffix[1:]))
    return number * Decimal(_SUFFIXES[suffix])


def name_errors(name: str, dns_label: bool = False) -> list[tuple[str, str]]:
    limit, pattern = (63, _DNS_LABEL) if dns_label else (253, _DNS_SUBDOMAIN)
    if len(name) > limit:
        return [("metadata.name", f'Invalid value: "{name}": must be no more than {limit} characters')]
    if not pattern.match(name):
        what = "RFC 1123 label" if dns_label else "RFC 1123 subdomain"
        return [
            (
                "metadata.name",
                f'Invalid value: "{name}": a lowercase {what} must consist of lower case alphanumeric '
                "characters, '-' or '.', and must start and end with an alphanumeric character",
            )
        ]
    return []


def _qualified_name_ok(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME.match(name))


def metadata_errors(meta: dict[str, Any]) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        return [("metadata.labels", "Invalid value: must be a map of strings")]
    for key, value in labels.items():
        if not _qualified_name_ok(key):
            errors.append(
                (
                    "metadata.labels",
                    f'Invalid value: "{key}": name part must consist of alphanumeric '
                    "characters, '-', '_' or '.', and must start and end with an alphanumeric character",
                )
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            errors.append(
                (
                    "metadata.labels",
                    f'Invalid value: "{value}": a valid label must be an empty string '
                    "or consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                    "with an alphanumeric character",
                )
            )
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        return errors + [("metadata.annotations", "Invalid value: must be a map of strings")]
    total = 0
    for key, value in annotations.items():
        if not isinstance(value, str):
            errors.append(("metadata.annotations", f"Invalid value: annotation {key!r} must be a string"))
            continue
        if not _qualified_name_ok(key):
            errors.append(
                (
                    "metadata.annotations",
                    f'Invalid value: "{key}": name part must consist of '
                    "alphanumeric characters, '-', '_' or '.'",
                )
            )
        total += len(key) + len(value)
    if total > ANNOTATIONS_MAX_BYTES:
        errors.append(("metadata.annotations", f"Too long: must have at most {ANNOTATIONS_MAX_BYTES} bytes"))
    return errors


def _is_extended(resource: str) -> bool:
    if resource in _NATIVE or resource.startswith("hugepages-") or resource.startswith("requests."):
        return False
    return "/" in resource and not resource.split("/", 1)[0].endswith("kubernetes.io")


def default_and_validate_pod_spec(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """Default requests from limits and apply the extended-resource rules of ValidatePodSpec."""
    errors: list[tuple[str, str]] = []
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [("spec.containers", "Required value")]
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            if not isinstance(c, dict) or not c.get("name"):
                errors.append((f"spec.{field}[{i}].name", "Required value"))
                continue
            res = c.get("resources")
            if res is None:
                res = c["resources"] = {}
            elif not isinstance(res, dict):
                errors.append((f"spec.{field}[{i}].resources", "Invalid value: must be an object"))
                continue
            for kind in ("limits", "requests"):
                if isinstance(res.get(kind), dict):
                    # Quantities are strings on the wire, whatever number the client sent.
                    res[kind] = {k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                                 for k, v in res[kind].items()}  # fmt: skip
            limits = res.get("limits") or {}
            requests = res.get("requests") or {}
            if limits:
                merged = dict(limits)
                merged.update(requests)
                res["requests"] = requests = merged
            for name, value in {**limits, **requests}.items():
                q = parse_quantity(value)
                where = f"spec.{field}[{i}].resources"
                if q is None:
                    errors.append(
                        (
                            f"{where}.limits[{name}]",
                            f'Invalid value: "{value}": quantities must match '
                            "the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
                        )
                    )
                    continue
                if q < 0:
                    errors.append(
                        (
                            f"{where}.limits[{name}]",
                            f'Invalid value: "{value}": must be greater than or equal to 0',
                        )
                    )
                if _is_extended(name):
                    if q != q.to_integral_value():
                        errors.append(
                            (f"{where}.requests[{name}]", f'Invalid value: "{value}": must be an integer')
                        )
                    if name not in limits:
                        errors.append(
                            (
                                f"{where}.limits",
                                "Required value: Limit must be set for non overcommitable resources",
                            )
                        )
                    elif parse_quantity(limits[name]) != parse_quantity(requests.get(name, limits[name])):
                        errors.append(
                            (
                                f"{where}.requests[{name}]",
                                f'Invalid value: "{requests[name]}": must be '
                                f"equal to {name} limit of {limits[name]}",
                            )
                        )
    return errors


def qos_class(spec: dict[str, Any]) -> str:
    containers = [
        c for c in (spec.get("containers") or []) + (spec.get("initContainers") or []) if isinstance(c, dict)
    ]
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for name in ("cpu", "memory"):
            if name in limits or name in requests:
                any_set = True
            if name not in limits or parse_quantity(limits[name]) != parse_quantity(
                requests.get(name, limits[name])
            ):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


# Pod spec fields a plain update may change (ValidatePodUpdate); everything else is immutable,
# in particular spec.nodeName, which only pods/binding may set.
def mutable_pod_spec_view(spec: dict[str, Any]) -> dict[str, Any]:
    view = {
        k: v
        for k, v in spec.items()
        if k
        not in ("activeDeadlineSeconds", "tolerations", "schedulingGates", "terminationGracePeriodSeconds")
    }
    for field in ("containers", "initContainers"):
        if isinstance(view.get(field), list):
            view[field] = [
                {k: v for k, v in c.items() if k != "image"} if isinstance(c, dict) else c
                for c in view[field]
            ]
    return view
