"""Host resources (CPU, memory, ephemeral storage, hugepages, extended resources) as
kube-scheduler's NodeResourcesFit counts them: a pod's request and a node's allocatable."""

from __future__ import annotations

import functools
from decimal import ROUND_CEILING, ROUND_FLOOR
from typing import Any, NamedTuple

from gpupack.contract import RES_GPU, ContractError, parse_quantity

MIB = 1024 * 1024


class HostUse(NamedTuple):
    """Host resources a pod requests (or a node has allocatable), as kube-scheduler's
    NodeResourcesFit counts them: CPU (milli), memory and ephemeral storage (bytes), and every
    other resource it checks (hugepages-*, extended resources outside gpupack.io) by name, sorted,
    as whole units (Quantity.Value(), rounded up)."""

    cpu_milli: int = 0
    mem_bytes: int = 0
    eph_bytes: int = 0
    other: tuple[tuple[str, int], ...] = ()


class HostPod(NamedTuple):
    """What the extender keeps of an assigned pod (any pod, gpupack's or not) for its node's host
    resources: a 50,000-pod cluster costs a few MiB, not its full Pod objects."""

    uid: str
    node: str
    use: HostUse


NO_HOST_USE = HostUse()
# Resources the container API names without a domain that NodeResourcesFit checks as scalars.
_HUGEPAGES = "hugepages-"
_GPUPACK_GROUP = RES_GPU.split("/", 1)[0] + "/"


def _amount(raw: Any, scale: int, rounding: str) -> int:
    """A quantity times `scale`, rounded as kube-scheduler does (requests: MilliValue rounds up);
    an unreadable one counts 0 (the API server validated it, so none should be)."""
    if raw is None:
        return 0
    if isinstance(raw, str):
        return _amount_of_text(raw, scale, rounding)
    return _parsed_amount(raw, scale, rounding)


@functools.lru_cache(maxsize=4096)
def _amount_of_text(raw: str, scale: int, rounding: str) -> int:
    # a fleet's pods ask for a few dozen distinct quantities; every watch event parsed them again
    return _parsed_amount(raw, scale, rounding)


def _parsed_amount(raw: Any, scale: int, rounding: str) -> int:
    try:
        q = parse_quantity(raw, "quantity")
    except ContractError:
        return 0
    return max(0, int((q * scale).to_integral_value(rounding=rounding)))


def _counted_other(name: str) -> bool:
    """Whether NodeResourcesFit checks `name` as a scalar resource for gpupack's profile: hugepages
    and every resource with a domain (extended resources) except gpupack's own, which its
    ignoredResourceGroups skips and the extender accounts per GPU."""
    return name.startswith(_HUGEPAGES) or ("/" in name and not name.startswith(_GPUPACK_GROUP))


def _resources_use(req: Any, lim: Any, rounding: str = ROUND_CEILING) -> HostUse:
    """The host resources of one resource list pair (requests, limits): the API server defaults a
    missing request to its limit, so a limit alone is read as it would have been."""
    req = req if isinstance(req, dict) else {}
    lim = lim if isinstance(lim, dict) else {}
    cpu = req.get("cpu", lim.get("cpu"))
    mem = req.get("memory", lim.get("memory"))
    eph = req.get("ephemeral-storage", lim.get("ephemeral-storage"))
    names = sorted(n for n in {*req, *lim} if isinstance(n, str) and _counted_other(n))
    other = tuple((n, _amount(req.get(n, lim.get(n)), 1, rounding)) for n in names)
    return HostUse(_amount(cpu, 1000, rounding), _amount(mem, 1, rounding), _amount(eph, 1, rounding), other)


def _container_use(c: Any) -> HostUse:
    if not isinstance(c, dict):
        return NO_HOST_USE
    res = c.get("resources") or {}
    if not isinstance(res, dict):
        return NO_HOST_USE
    return _resources_use(res.get("requests"), res.get("limits"))


def _merge_other(
    a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...], add: bool
) -> tuple[tuple[str, int], ...]:
    if not b:
        return a
    if not a:
        return b
    d = dict(a)
    for k, v in b:
        d[k] = d.get(k, 0) + v if add else max(d.get(k, 0), v)
    return tuple(sorted(d.items()))


def host_plus(a: HostUse, b: HostUse) -> HostUse:
    return HostUse(a.cpu_milli + b.cpu_milli, a.mem_bytes + b.mem_bytes, a.eph_bytes + b.eph_bytes,
                   _merge_other(a.other, b.other, True))  # fmt: skip


def host_max(a: HostUse, b: HostUse) -> HostUse:
    return HostUse(max(a.cpu_milli, b.cpu_milli), max(a.mem_bytes, b.mem_bytes), max(a.eph_bytes, b.eph_bytes),
                   _merge_other(a.other, b.other, False))  # fmt: skip


def pod_host_request(obj: Any) -> HostUse:
    """A pod's host resource request as kube-scheduler computes it (k8s.io/component-helpers
    resource.PodRequests): per resource, max(sum of app containers plus restartable (sidecar) init
    containers, the largest init container plus the sidecars started before it), plus the pod's
    overhead."""
    spec = (obj.get("spec") or {}) if isinstance(obj, dict) else {}
    if not isinstance(spec, dict):
        return NO_HOST_USE
    app = NO_HOST_USE
    for c in spec.get("containers") or []:
        app = host_plus(app, _container_use(c))
    side = init = NO_HOST_USE
    for c in spec.get("initContainers") or []:
        u = _container_use(c)
        if isinstance(c, dict) and c.get("restartPolicy") == "Always":
            side = host_plus(side, u)
            init = host_max(init, side)
        else:
            init = host_max(init, host_plus(u, side))
    use = host_max(host_plus(app, side), init)
    over = spec.get("overhead")
    if isinstance(over, dict) and over:
        use = host_plus(use, _resources_use(over, None))
    return use


def ram_mib(mem_bytes: int) -> int:
    """Requested bytes as the core's whole MiB, rounded up (never less than is asked)."""
    return -(-mem_bytes // MIB)


def grew(before: HostUse, after: HostUse) -> bool:
    """Whether any resource of `after` exceeds `before`'s."""
    if (
        after.cpu_milli > before.cpu_milli
        or after.mem_bytes > before.mem_bytes
        or after.eph_bytes > before.eph_bytes
    ):
        return True
    had = dict(before.other)
    return any(v > had.get(k, 0) for k, v in after.other)


def allocatable_host(obj: dict[str, Any]) -> tuple[HostUse, int]:
    """A node's allocatable host resources and how many pods it allows (status.allocatable)."""
    alloc = (obj.get("status") or {}).get("allocatable") or {}
    return _resources_use(alloc, None, ROUND_FLOOR), _amount(alloc.get("pods"), 1, ROUND_FLOOR)
