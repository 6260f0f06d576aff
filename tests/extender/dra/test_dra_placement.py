"""The DRA allocator's pure parts: claims read as hostile input, devices and what allocated claims
consume of them, and placement through gpupack's policy (packing, the class rule, capacity)."""

from __future__ import annotations

from typing import Any

import pytest

from draplugin.slices import resource_slice
from extender.controllers.dra.claims import Ask, ClaimError, claim_asks, pod_claim_names
from extender.controllers.dra.devices import charge_claims, consumed, slice_devices
from extender.controllers.dra.placement import place
from gpupack.contract import GPUInfo
from gpupack.core import node_rules as nr
from gpupack.core.policies import get_policy

CLASSES = {"gpupack-online": "online", "gpupack-offline": "offline"}
MEM = 81920


def _claim(
    name: str, cls: str = "gpupack-online", capacity: dict[str, Any] | None = None, **ex: Any
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, **ex}
    if capacity is not None:
        exactly["capacity"] = {"requests": capacity}
    return {"metadata": {"name": name, "namespace": "ns"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}  # fmt: skip


def _devices(nodes: int = 2, gpus: int = 2) -> dict[str, Any]:
    slices = [
        resource_slice(
            f"n{i}",
            [GPUInfo(uuid=f"G{i}{j}", index=j, model="A100", mem_mib=MEM, sm_count=108) for j in range(gpus)],
        )  # fmt: skip
        for i in range(nodes)
    ]
    return slice_devices(slices)


def _facts(nodes: int = 2, cpu: int = 64000) -> dict[str, nr.NodeFacts]:
    return {
        f"n{i}": nr.NodeFacts(name=f"n{i}", cpu_milli=cpu, mem_bytes=1 << 40, pods=110) for i in range(nodes)
    }


def _allocated(name: str, cls: str, node: str, device: str, mem: str, sm: str) -> dict[str, Any]:
    c = _claim(name, cls, {"memory": mem, "sm": sm})
    c["status"] = {"allocation": {"devices": {"results": [
        {"driver": "gpu.gpupack.io", "pool": node, "device": device, "request": "gpu",
         "consumedCapacity": {"memory": mem, "sm": sm}}]}}}  # fmt: skip
    return c


def test_claims_are_read_as_gpupack_can_place_them_or_refused_with_a_reason() -> None:
    (a,) = claim_asks(_claim("c", capacity={"memory": "20Gi", "sm": "40"}), CLASSES)
    assert (a.count, a.mem_mib, a.sm_pct, a.pod_class) == (1, 20480, 40, "online")
    (w,) = claim_asks(_claim("w", "gpupack-offline", count=2), CLASSES)
    assert w.whole and w.count == 2 and w.pod_class == "offline"
    assert claim_asks(_claim("x", "other-class"), CLASSES) == []  # not ours: the scheduler's
    sel = [{"cel": {"expression": 'device.attributes["gpu.gpupack.io"].model in ["A100", "H100"]'}}]
    (m,) = claim_asks(_claim("m", selectors=sel), CLASSES)
    assert m.models == frozenset({"A100", "H100"})
    # a memory request is rounded up to whole MiB, the slice's step; 0 is the minimum 1 MiB
    assert claim_asks(_claim("r", capacity={"memory": "1"}), CLASSES)[0].mem_mib == 1


@pytest.mark.parametrize(
    ("claim", "why"),
    [
        (_claim("a", capacity={"sm": "1e999999"}), "out of range"),
        (_claim("b", capacity={"sm": "101"}), "100 percent"),
        (_claim("c", capacity={"memory": "-1Gi"}), "out of range"),
        (_claim("d", capacity={"memory": "lots"}), "not a Kubernetes quantity"),
        (_claim("e", capacity={"cores": "1"}), "no capacity cores"),
        (_claim("f", count=10**9), "count must be"),
        (_claim("g", count=True), "count must be"),
        (_claim("h", allocationMode="All"), "ExactCount"),
        (_claim("i", adminAccess=True), "adminAccess"),
        (
            _claim("j", selectors=[{"cel": {"expression": "true || device.attributes.x"}}]),
            "selectors of the form",
        ),
        (_claim("k", selectors=[{"cel": {"expression": "x"}}] * 5), "more than 4 selectors"),
    ],
)
def test_a_hostile_claim_is_refused_with_its_reason(claim: dict[str, Any], why: str) -> None:
    with pytest.raises(ClaimError, match=why):
        claim_asks(claim, CLASSES)


def test_a_claim_mixing_classes_or_drivers_is_refused() -> None:
    c = _claim("mix")
    c["spec"]["devices"]["requests"].append({"name": "o", "exactly": {"deviceClassName": "gpupack-offline"}})
    with pytest.raises(ClaimError, match="both online and offline"):
        claim_asks(c, CLASSES)
    c["spec"]["devices"]["requests"][1]["exactly"]["deviceClassName"] = "nic"
    with pytest.raises(ClaimError, match="mixes gpupack requests with others"):
        claim_asks(c, CLASSES)


def test_pod_claim_names_wait_for_a_templates_claim() -> None:
    pod = {"spec": {"resourceClaims": [{"name": "a", "resourceClaimName": "direct"},
                                       {"name": "b", "resourceClaimTemplateName": "t"}]}}  # fmt: skip
    assert pod_claim_names(pod) == [("a", "direct"), ("b", None)]
    pod["status"] = {"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "made-b"}]}
    assert pod_claim_names(pod) == [("a", "direct"), ("b", "made-b")]


def test_consumed_capacity_takes_the_request_policys_defaults() -> None:
    dev = _devices(1, 1)["n0"][0]
    assert consumed(dev, 20480, 40) == {"memory": "20480Mi", "sm": "40"}
    assert consumed(dev, None, None) == {"memory": f"{MEM}Mi", "sm": "0"}  # a whole GPU: all memory, no SMs
    assert consumed(dev, 100, None) == {"memory": "100Mi", "sm": "0"}


def _place(
    asks: list[Ask],
    devices: dict[str, Any],
    facts: dict[str, nr.NodeFacts] | None = None,
    policy: str = "gpupack",
) -> Any:
    return place("ns/p", asks, devices, facts or _facts(len(devices)), {}, nr.PodTerms(), get_policy(policy))


def _ask(
    cls: str = "online", mem: int | None = 20480, sm: int | None = 40, count: int = 1, claim: str = "c"
) -> Ask:
    return Ask(claim, "gpu", f"gpupack-{cls}", cls, count, mem, sm)


@pytest.mark.parametrize(
    ("held", "asked", "expect_device"),
    [
        # a share packs onto the GPU already holding a share of its class (BestFit: the tightest GPU)
        ([("online", "n1", "gpu-1", "20Gi", "60")], "online", ("n1", "gpu-1")),
        # ...and never onto one holding the other class, even with room
        ([("offline", "n1", "gpu-1", "20Gi", "40")], "online", None),
        # a GPU with no room left (60 % + 40 % would fit, 70 % + 40 % not) is skipped
        ([("online", "n0", "gpu-0", "20Gi", "70")], "online", None),
    ],
)
def test_placement_packs_keeps_classes_apart_and_never_overfills(
    held: list[tuple[str, str, str, str, str]], asked: str, expect_device: tuple[str, str] | None
) -> None:
    devices = _devices()
    claims = [_allocated(f"h{i}", f"gpupack-{c}", n, d, m, s) for i, (c, n, d, m, s) in enumerate(held)]
    charge_claims(devices, claims, CLASSES)
    chosen = _place([_ask(asked)], devices, policy="bestfit")
    assert not isinstance(chosen, str), chosen
    (r,) = chosen.results["c"]
    got = (r["pool"], r["device"])
    if expect_device is not None:
        assert got == expect_device
    else:
        assert got not in {(n, d) for _, n, d, _, _ in held}
    assert r["consumedCapacity"] == {"memory": "20480Mi", "sm": "40"}


def test_no_room_anywhere_is_a_reason_not_a_placement() -> None:
    devices = _devices(1, 1)
    charge_claims(devices, [_allocated("h", "gpupack-offline", "n0", "gpu-0", "10Gi", "10")], CLASSES)
    why = _place([_ask("online")], devices)
    assert isinstance(why, str) and "0/1 nodes" in why
    # the CPU a node has left counts too: kube-scheduler would not bind the pod there
    terms = nr.PodTerms(needs=nr.HostNeeds(cpu_milli=2000))
    small = {"n0": nr.NodeFacts(name="n0", cpu_milli=1000, mem_bytes=1 << 40, pods=110)}
    why = place("ns/p", [_ask("offline")], _devices(1, 1), small, {}, terms, get_policy("gpupack"))
    assert isinstance(why, str) and "cpu" in why


def test_whole_gpus_and_two_requests_of_one_pod() -> None:
    devices = _devices(1, 2)
    chosen = _place([_ask(mem=None, sm=None, count=2)], devices)
    assert not isinstance(chosen, str)
    assert sorted(r["device"] for r in chosen.results["c"]) == ["gpu-0", "gpu-1"]
    assert all(r["consumedCapacity"] == {"memory": f"{MEM}Mi", "sm": "0"} for r in chosen.results["c"])
    # two share claims of one pod may land on one GPU: their sum must fit it
    both = _place([_ask(sm=60, claim="a"), _ask(sm=60, claim="b")], _devices(1, 2))
    assert not isinstance(both, str)
    assert both.results["a"][0]["device"] != both.results["b"][0]["device"]
    assert isinstance(_place([_ask(sm=60, claim="a"), _ask(sm=60, claim="b")], _devices(1, 1)), str)


def test_class_flags_are_checked() -> None:
    import argparse

    from extender.controllers.dra import flags

    p = argparse.ArgumentParser()
    flags.add_flags(p)
    assert flags.classes_from_args(p.parse_args([])) == CLASSES
    both = p.parse_args(["--dra-online-class", "x", "--dra-offline-class", "x"])
    with pytest.raises(ValueError, match="both online and offline"):
        flags.classes_from_args(both)
    with pytest.raises(SystemExit):
        p.parse_args(["--dra-offline-class", "Not/A Name"])
