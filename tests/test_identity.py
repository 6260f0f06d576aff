"""gpupack.identity: the pure PreStartContainer decision, and the allocation record's device IDs."""

from __future__ import annotations

import json

import pytest

from gpupack import contract, handoff, identity
from gpupack.contract import (
    ANN_ALLOCATED,
    ANN_ASSIGNMENT,
    ANN_HANDOFF,
    RES_GPU,
    SCHEDULER_NAME,
    Assignment,
    ContractError,
    GPUShare,
)
from gpupack.identity import Holder

A, B = "GPU-aaaa", "GPU-bbbb"
NODE = "n1"


def ids(uuid: str, *slots: int) -> frozenset[str]:
    return frozenset(f"{uuid}::{k}" for k in slots)


def assignment(
    uid: str, gpu: str = A, node: str = NODE, containers: tuple[str, ...] = ("main",)
) -> Assignment:
    return Assignment(uid, node, "online", {c: (GPUShare(gpu, 0, 1000, 25),) for c in containers})


def pod(
    name: str,
    *,
    uid: str | None = None,
    a: Assignment | None = None,
    served: dict[str, frozenset[str]] | None = None,
    state: str | None = contract.HANDOFF_DONE,
    node: str = NODE,
    phase: str = "Pending",
    raw_record: str | None = None,
) -> dict:
    uid = uid or f"uid-{name}"
    ann: dict[str, str] = {}
    if a is not None:
        ann[ANN_ASSIGNMENT] = a.to_json()
    if state is not None and a is not None:
        ann[ANN_HANDOFF] = state
    if served is not None and a is not None:
        ann[ANN_ALLOCATED] = contract.encode_allocated(list(served), a, served)
    if raw_record is not None:
        ann[ANN_ALLOCATED] = raw_record
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "annotations": ann, "resourceVersion": "5"},
        "spec": {
            "nodeName": node,
            "schedulerName": SCHEDULER_NAME,
            "containers": [{"name": "main", "resources": {"limits": {RES_GPU: "1"}}}],
        },
        "status": {"phase": phase},
    }


OWN_IDS = ids(A, 3)
OWN = pod("own", a=assignment("uid-own"), served={"main": OWN_IDS})


def held(name: str, devs: frozenset[str], container: str = "main") -> Holder:
    return Holder("ns", name, container, devs)


# --- accept / refuse table ---------------------------------------------------------------------------
CASES = [
    # (what, PodResources answer, pods on the node, device IDs, accept, reason)
    ("own pod, own ids", [held("own", OWN_IDS)], [OWN], OWN_IDS, True, ""),
    ("other containers hold other ids", [held("x", ids(B, 1)), held("own", OWN_IDS)], [OWN], OWN_IDS, True, ""),
    ("no answer for these ids", [held("own", ids(A, 4))], [OWN], OWN_IDS, False, identity.REASON_NO_HOLDER),
    ("a superset is not a holder", [held("own", OWN_IDS | ids(A, 4))], [OWN], OWN_IDS, False, "no_holder"),
    ("two pods list them", [held("own", OWN_IDS), held("x", OWN_IDS)], [OWN], OWN_IDS, False, "ambiguous"),
    ("no ids at all", [held("own", OWN_IDS)], [OWN], frozenset(), False, identity.REASON_AMBIGUOUS),
    ("holder unknown to the API", [held("static", OWN_IDS)], [OWN], OWN_IDS, False, "not_placed"),
    ("holder without assignment", [held("u", OWN_IDS)], [pod("u")], OWN_IDS, False, "not_placed"),
    ("record of another uid", [held("c", OWN_IDS)],
     [pod("c", a=assignment("uid-own"), served={"main": OWN_IDS})], OWN_IDS, False, "not_placed"),
    ("record for another node", [held("o", OWN_IDS)],
     [pod("o", a=assignment("uid-o", node="n2"), served={"main": OWN_IDS})], OWN_IDS, False, "not_placed"),
    ("handoff failed", [held("l", OWN_IDS)],
     [pod("l", a=assignment("uid-l"), served={"main": OWN_IDS}, state="failed")], OWN_IDS, False, "handoff_failed"),
    ("assigned but never served", [held("p", OWN_IDS)],
     [pod("p", a=assignment("uid-p"), state="pending")], OWN_IDS, False, "not_recorded"),
    ("served other ids", [held("p", OWN_IDS)],
     [pod("p", a=assignment("uid-p"), served={"main": ids(A, 9)})], OWN_IDS, False, "not_recorded"),
    ("old record (names only), slot of its GPU", [held("o", OWN_IDS)],
     [pod("o", a=assignment("uid-o"), raw_record='["main"]')], OWN_IDS, True, ""),
    ("old record (names only), slot of another GPU", [held("o", ids(B, 0))],
     [pod("o", a=assignment("uid-o"), raw_record='["main"]')], ids(B, 0), False, "not_recorded"),
    ("corrupt record", [held("o", OWN_IDS)],
     [pod("o", a=assignment("uid-o"), raw_record="{")], OWN_IDS, False, "not_placed"),
    ("pod on another node", [held("own", OWN_IDS)], [pod("own", a=assignment("uid-own"), served={"main": OWN_IDS},
     node="n2")], OWN_IDS, False, "not_placed"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "answer", "pods", "devs", "accept", "reason"), CASES, ids=[c[0] for c in CASES]
)
def test_decide(what, answer, pods, devs, accept, reason):
    d = identity.decide(answer, pods, NODE, devs)
    assert (d.accept, d.reason) == (accept, reason), d.message
    assert d.reason in ("", *identity.REASONS)
    if not accept:
        assert d.message and (f"{RES_GPU} devices" in d.message or "without" in d.message), d.message


def test_init_and_app_container_holding_the_same_ids_must_both_be_recorded():
    a = assignment("uid-p", containers=("warm", "main"))
    answer = [held("p", OWN_IDS, "warm"), held("p", OWN_IDS, "main")]
    both = pod("p", a=a, served={"warm": OWN_IDS, "main": OWN_IDS})
    assert identity.decide(answer, [both], NODE, OWN_IDS).accept
    only_init = pod("p", a=a, served={"warm": OWN_IDS})
    d = identity.decide(answer, [only_init], NODE, OWN_IDS)
    assert (d.accept, d.reason) == (False, "not_recorded") and "container main" in d.message


# --- repairs -----------------------------------------------------------------------------------------
def test_refusal_repairs_the_pod_whose_record_the_intruder_consumed():
    victim = pod("victim", a=assignment("uid-victim"), served={"main": OWN_IDS})
    d = identity.decide([held("stray", OWN_IDS)], [pod("stray"), victim], NODE, OWN_IDS)
    assert (d.accept, d.reason, d.holder) == (False, "not_placed", "ns/stray")
    [r] = d.repairs
    assert (r.pod.key, r.containers, r.handoff) == ("ns/victim", ("main",), contract.HANDOFF_PENDING)
    assert r.patch == {ANN_HANDOFF: contract.HANDOFF_PENDING, ANN_ALLOCATED: None}
    assert r.pod.resource_version == "5"
    assert "pod ns/stray container main holds" in d.message and "ns/victim no longer claims" in d.message


def test_repair_keeps_the_other_containers_and_their_ids():
    a = assignment("uid-v", containers=("first", "main"))
    victim = pod("v", a=a, served={"first": ids(B, 0), "main": OWN_IDS})
    [r] = identity.repairs_for([handoff.pod_view(victim)], NODE, OWN_IDS, "ns/intruder")
    rec = contract.decode_allocation_record(r.patch[ANN_ALLOCATED], "v")
    assert rec.served == ["first"] and rec.ids == {"first": ids(B, 0)}
    assert rec.held is not None and set(rec.held.containers) == {"first"}


def test_repair_sets_failed_when_another_pod_waits_on_the_node():
    victim = pod("v", a=assignment("uid-v"), served={"main": OWN_IDS})
    waiting = pod("w", a=assignment("uid-w", gpu=B), state="pending")
    [r] = identity.repairs_for(map(handoff.pod_view, [victim, waiting]), NODE, OWN_IDS, "ns/intruder")
    assert r.handoff == contract.HANDOFF_FAILED and "delete it" in r.describe()


def test_no_repair_of_terminal_pods_the_holder_itself_or_unrelated_ids():
    gone = pod("g", a=assignment("uid-g"), served={"main": OWN_IDS}, phase="Succeeded")
    unrelated = pod("u", a=assignment("uid-u", gpu=B), served={"main": ids(B, 2)})
    holder = pod("h", a=assignment("uid-h"), served={"main": OWN_IDS}, state="failed")
    running = pod("r", a=assignment("uid-r"), served={"main": OWN_IDS}, phase="Running")
    views = list(map(handoff.pod_view, [gone, unrelated, holder, running]))
    assert identity.repairs_for(views, NODE, OWN_IDS, "ns/h", "uid-h") == []


# --- the record format -------------------------------------------------------------------------------
def test_record_stores_ids_per_served_container_and_reads_back():
    a = assignment("uid-p", containers=("warm", "main"))
    text = contract.encode_allocated(["warm", "main"], a, {"warm": ["x::1"], "main": {"x::2", "x::1"}})
    d = json.loads(text)
    assert d["ids"] == {"warm": ["x::1"], "main": ["x::1", "x::2"]}
    rec = contract.decode_allocation_record(text, "p")
    assert rec.served == ["warm", "main"] and rec.ids == {"warm": frozenset({"x::1"}), "main": ids("x", 1, 2)}
    assert (
        contract.decode_allocated(text) == ["warm", "main"] and contract.decode_allocation(text) == rec.held
    )


def test_older_records_still_read():
    a = assignment("uid-p")
    without_ids = contract.encode_allocated(["main"], a)
    assert "ids" not in json.loads(without_ids)
    rec = contract.decode_allocation_record(without_ids, "p")
    assert rec.served == ["main"] and rec.ids == {} and rec.held == a
    names = contract.decode_allocation_record('["main"]', "p")
    assert names.served == ["main"] and names.held is None and names.ids == {}


@pytest.mark.parametrize(
    "ids_field",
    [[], {"main": "x::1"}, {"main": [1]}, {"other": ["x::1"]}],
    ids=["list", "str", "int", "unserved"],
)
def test_bad_ids_are_refused_with_a_clear_error(ids_field):
    d = json.loads(contract.encode_allocated(["main"], assignment("uid-p")))
    d["ids"] = ids_field
    with pytest.raises(ContractError, match="ids"):
        contract.decode_allocation_record(json.dumps(d), "p")


def test_plan_allocate_records_the_device_ids_it_served():
    a = Assignment("uid-p", NODE, "online", {"main": (GPUShare(A, 0, 1000, 25),)})
    p = pod("p", a=a, state="pending")
    plan = handoff.plan_allocate(p, NODE, OWN_IDS, {A: True})
    rec = contract.decode_allocation_record(plan.patch[ANN_ALLOCATED], "p")
    assert rec.ids == {"main": OWN_IDS} and plan.patch[ANN_HANDOFF] == contract.HANDOFF_DONE


def test_after_a_failed_allocate_records_whose_ids_another_pod_holds_are_handed_back():
    """A wrong pod's first container consumed the pending pod's assignment, its next container's
    Allocate failed: the kubelet rejects it without PreStartContainer, so the repair happens then."""
    victim = pod("v", a=assignment("uid-v"), served={"main": OWN_IDS})
    own = pod("own2", a=assignment("uid-own2", gpu=B), served={"main": ids(B, 1)})
    answer = [held("wrong", OWN_IDS, "a"), held("own2", ids(B, 1))]
    [r] = identity.consumed_repairs(answer, [victim, own], NODE)
    assert (r.pod.key, r.containers, r.handoff) == ("ns/v", ("main",), contract.HANDOFF_PENDING)
    assert identity.consumed_repairs([held("v", OWN_IDS), held("own2", ids(B, 1))], [victim, own], NODE) == []
