"""The DRA replay (benchmarks/replay_dra.py, `replay_realk8s.py --mode dra`) on a handful of pods
through the real v1.36 kube-scheduler's allocator, and the consumed-capacity check it ends with
(benchmarks/dra_objects.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kubernetes import client

from gpupack.simulate.openb import NodeList, PodList

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dra_objects as dra  # noqa: E402
import replay_dra  # noqa: E402

# --- the check, on hand-written claims ----------------------------------------------------------


def _slice(pool: str, devices: int = 2, mem: str = "15109Mi") -> dict[str, Any]:
    return {"spec": {"driver": dra.DRIVER, "pool": {"name": pool},
                     "devices": [{"name": f"gpu-{j}", "capacity": {"memory": {"value": mem}, "sm": {"value": "100"}}}
                                 for j in range(devices)]}}  # fmt: skip


def _claim(name: str, pool: str, device: str, consumed: dict[str, str] | None) -> dict[str, Any]:
    r: dict[str, Any] = {"request": "gpu", "driver": dra.DRIVER, "pool": pool, "device": device}
    if consumed is not None:
        r["consumedCapacity"] = consumed
    return {"metadata": {"namespace": "t", "name": name},
            "status": {"allocation": {"devices": {"results": [r]}}}}  # fmt: skip


def test_capacity_check_passes_a_device_filled_exactly():
    claims = [
        _claim("a", "n1", "gpu-0", {"memory": "1Mi", "sm": "60"}),
        _claim("b", "n1", "gpu-0", {"memory": "15108Mi", "sm": "40"}),
        _claim("c", "n1", "gpu-1", {"memory": "15109Mi", "sm": "0"}),
    ]
    assert dra.capacity_overfills([_slice("n1")], claims) == []
    assert dra.check_capacity([_slice("n1")], claims) == 2


def test_capacity_check_catches_an_overfill_summed_over_claims():
    claims = [
        _claim("a", "n1", "gpu-0", {"memory": "1Mi", "sm": "60"}),
        _claim("b", "n1", "gpu-0", {"memory": "1Mi", "sm": "50"}),  # 110 of 100
        _claim("c", "n2", "gpu-0", {"memory": "1Mi", "sm": "50"}),  # another pool: its own device
    ]
    bad = dra.capacity_overfills([_slice("n1"), _slice("n2")], claims)
    assert len(bad) == 1
    assert "gpu-0 of pool n1" in bad[0] and "sm consumed 110 > capacity 100" in bad[0]
    assert "t/a" in bad[0] and "t/b" in bad[0]
    with pytest.raises(dra.CapacityExceeded, match="1 device capacities exceeded"):
        dra.check_capacity([_slice("n1"), _slice("n2")], claims)


def test_capacity_check_counts_a_result_without_consumed_capacity_as_the_whole_device():
    # a device handed out whole (no consumedCapacity recorded) and a share beside it: overfilled
    claims = [
        _claim("whole", "n1", "gpu-1", None),
        _claim("share", "n1", "gpu-1", {"memory": "1Mi", "sm": "10"}),
    ]
    bad = dra.capacity_overfills([_slice("n1")], claims)
    assert any("memory consumed" in b for b in bad) and any("sm consumed 110" in b for b in bad)


def test_capacity_check_reports_a_device_no_slice_publishes():
    bad = dra.capacity_overfills([_slice("n1")], [_claim("a", "n1", "gpu-7", {"sm": "1"})])
    assert bad == ["claim t/a: device gpu-7 of pool n1 is in no ResourceSlice"]


def test_claim_specs_ask_a_share_or_whole_gpus():
    share = dra.claim_spec(1, 1, 30, models={"T4", "A10"})["devices"]["requests"][0]["exactly"]
    assert share["capacity"] == {"requests": {"memory": "1Mi", "sm": "30"}}
    assert (
        share["selectors"][0]["cel"]["expression"]
        == 'device.attributes["gpu.gpupack.io"].model in ["A10", "T4"]'
    )
    whole = dra.claim_spec(2)["devices"]["requests"][0]["exactly"]
    assert whole["count"] == 2 and "capacity" not in whole and "selectors" not in whole
    with pytest.raises(ValueError, match="a share is of one GPU"):
        dra.claim_spec(2, 0, 30)
    assert dra.allocated_milli(_claim("a", "n", "gpu-0", {"memory": "1Mi", "sm": "30"})) == 300
    assert dra.allocated_milli(_claim("b", "n", "gpu-0", {"memory": "15109Mi", "sm": "0"})) == 1000


# --- a few pods through the real scheduler ------------------------------------------------------

NODE = "dra-replay-n0"


def test_real_allocator_puts_several_shares_on_one_device(cluster, tmp_path):
    why = replay_dra.dra_unsupported(cluster)
    if why:
        pytest.skip(f"DRA replay needs consumable capacity (v1.36 assets): {why}")
    nodes = NodeList([NODE], np.array([16000]), np.array([65536]), np.array([2]), ["T4"])
    # three 30 % shares, one whole GPU, then a 20 % share that fits nowhere (90 % used, and the
    # whole GPU's memory taken), a share only a V100 may take, and a CPU-only pod
    num = np.array([1, 1, 1, 1, 1, 1, 0])
    milli = np.array([300, 300, 300, 1000, 200, 100, 0])
    spec: list[frozenset[str] | None] = [None, None, None, None, None, frozenset({"V100M16"}), None]
    pods = PodList([f"p{i}" for i in range(7)], np.full(7, 1000), np.full(7, 1024), num, milli, spec)
    ns = "replay-dra-test"
    try:
        res, info = replay_dra.replay_on_cluster(cluster, nodes, pods, np.arange(7), namespace=ns)
        assert res.decisions[5:] == [(-1, ()), (0, ())]
        assert res.decisions[4] == (-1, ())
        shares = {g for _, g in res.decisions[:3]}
        assert len(shares) == 1, f"the three shares on one device: {res.decisions}"
        assert res.decisions[3][0] == 0 and res.decisions[3][1] != next(iter(shares))
        assert res.placed == 5 and info["devices_in_use"] == 2 and info["shared_devices"] == 1
        # 3 x 300 + 1000 of 2 x 1000 milli allocated from the whole GPU's arrival (95 %) on
        assert res.unallocated_pct_at_100 == pytest.approx(5.0)
        api = client.ResourceV1Api(cluster.api_client())
        claims = json.loads(api.list_namespaced_resource_claim(ns, _preload_content=False).data)["items"]
        on_shared = [
            r for c in claims for r in dra.results(c) if r["device"] == f"gpu-{next(iter(shares))[0]}"
        ]
        assert [r["consumedCapacity"] for r in on_shared] == [{"memory": "1Mi", "sm": "30"}] * 3
        assert len({r["shareID"] for r in on_shared}) == 3
        whole = [r for c in claims for r in dra.results(c) if r not in on_shared]
        assert len(whole) == 1 and whole[0]["consumedCapacity"]["memory"] == "15109Mi"
        assert sum(dra.allocated_milli(c) for c in claims) == 1900
        assert [c["metadata"]["name"] for c in claims] == ["p00000", "p00001", "p00002", "p00003"]
    finally:
        api = client.ResourceV1Api(cluster.api_client())
        for call, name in ((api.delete_resource_slice, dra.node_slice(NODE, [])["metadata"]["name"]),
                           (api.delete_device_class, dra.DEVICE_CLASS)):  # fmt: skip
            try:
                call(name)
            except client.ApiException as e:
                if e.status != 404:
                    raise
