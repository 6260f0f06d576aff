"""The preemption victim chooser (gpupack.core.preemption): examples from the issue, and its rules
as properties over generated nodes, checked against brute force where a small node allows it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupack.core.fit import Fit, fit
from gpupack.core.model import GPU, ClusterState, ContainerRequest, Node, PodRequest, invariant_violations
from gpupack.core.preemption import (
    SYSTEM_PRIORITY,
    Preemptor,
    Victim,
    budget_violations,
    choose,
    may_evict,
    without,
)

MIB = 81920


def cluster(nodes: int, gpus: int) -> ClusterState:
    s = ClusterState()
    for n in range(nodes):
        s.add_node(Node(f"n{n}", [GPU(f"G-{n}-{i}", i, "H100", MIB) for i in range(gpus)]))
    return s


def put(s: ClusterState, key: str, cls: str, containers: tuple[ContainerRequest, ...], node: str) -> bool:
    pod = PodRequest(key, cls, containers)
    f = fit(s.nodes[node], pod)
    if not isinstance(f, Fit):
        return False
    s.place(pod, f.placement, f.charged)
    return True


def share(mem: int, sm: int, gpus: int = 1, name: str = "main") -> ContainerRequest:
    return ContainerRequest(name, gpus, mem, sm * 10)


def test_whole_gpu_takes_one_offline_pod() -> None:
    s = cluster(2, 1)
    for n in ("n0", "n1"):
        assert put(s, f"batch/{n}", "offline", (ContainerRequest("main", 1),), n)
    pods = {k: Victim(k, 100, "offline") for k in s.pods}
    c = choose(
        s.nodes.values(),
        Preemptor(PodRequest("web/a", "online", (ContainerRequest("main", 1),)), 100000),
        pods,
    )
    assert c is not None and len(c.victims) == 1 and c.fit.charged


def test_share_for_online_evicts_every_offline_pod_on_one_gpu() -> None:
    # the second scenario: four 30,000 MiB offline shares hold both GPUs; a 40,000 MiB
    # online share needs a GPU of its class, so both offline pods on one GPU go, not one
    s = cluster(2, 1)
    for i in range(4):
        assert put(s, f"batch/o{i}", "offline", (share(30000, 20),), f"n{i % 2}")
    pods = {k: Victim(k, 100, "offline") for k in s.pods}
    pre = Preemptor(PodRequest("web/a", "online", (share(40000, 40),)), 100000)
    c = choose(s.nodes.values(), pre, pods)
    assert c is not None and len(c.victims) == 2
    assert {s.pods[k][1].node for k in c.victims} == {c.node}


def test_same_class_share_evicts_only_what_it_needs() -> None:
    s = cluster(1, 1)
    for i, mem in enumerate((30000, 30000, 10000)):
        assert put(s, f"batch/o{i}", "offline", (share(mem, 20),), "n0")
    pods = {k: Victim(k, 100, "offline") for k in s.pods}
    pre = Preemptor(PodRequest("batch/hi", "offline", (share(40000, 30),)), 1000)
    c = choose(s.nodes.values(), pre, pods)
    assert c is not None and c.victims in (("batch/o0",), ("batch/o1",))  # one 30,000 MiB pod is enough


def test_equal_priority_never_and_system_pods_are_never_victims() -> None:
    s = cluster(1, 1)
    assert put(s, "batch/o", "offline", (ContainerRequest("main", 1),), "n0")
    req = PodRequest("web/a", "online", (ContainerRequest("main", 1),))
    assert (
        choose(s.nodes.values(), Preemptor(req, 100), {"batch/o": Victim("batch/o", 100, "offline")}) is None
    )
    assert (
        choose(s.nodes.values(), Preemptor(req, 10**6, may_preempt=False), {"batch/o": Victim("batch/o", 1)})
        is None
    )
    sys_pod = Victim("batch/o", SYSTEM_PRIORITY, "offline")
    assert choose(s.nodes.values(), Preemptor(req, 2 * SYSTEM_PRIORITY), {"batch/o": sys_pod}) is None


def test_no_eviction_for_a_pod_that_cannot_fit_anyway() -> None:
    s = cluster(1, 2)
    assert put(s, "batch/o", "offline", (ContainerRequest("main", 1),), "n0")
    assert put(s, "kube/x", "online", (ContainerRequest("main", 1),), "n0")
    pods = {"batch/o": Victim("batch/o", 1, "offline")}  # kube/x may not be evicted
    pre = Preemptor(PodRequest("web/a", "online", (ContainerRequest("main", 2),)), 1000)
    assert choose(s.nodes.values(), pre, pods) is None


def test_budget_is_respected_when_another_choice_exists() -> None:
    s = cluster(2, 1)
    for n in ("n0", "n1"):
        assert put(s, f"batch/{n}", "offline", (ContainerRequest("main", 1),), n)
    pods = {
        "batch/n0": Victim("batch/n0", 1, "offline", ("pdb",)),
        "batch/n1": Victim("batch/n1", 5, "offline"),
    }
    pre = Preemptor(PodRequest("web/a", "online", (ContainerRequest("main", 1),)), 1000)
    c = choose(s.nodes.values(), pre, pods, {"pdb": 0})
    assert c is not None and c.victims == ("batch/n1",) and c.budget_violations == 0
    # the only choice left violates it, and says so
    only = {"batch/n0": pods["batch/n0"]}
    c = choose(s.nodes.values(), pre, only, {"pdb": 0})
    assert c is not None and c.victims == ("batch/n0",) and c.budget_violations == 1


def test_lower_priority_evicted_before_higher() -> None:
    s = cluster(2, 1)
    for n in ("n0", "n1"):
        assert put(s, f"batch/{n}", "offline", (ContainerRequest("main", 1),), n)
    pods = {"batch/n0": Victim("batch/n0", 50, "offline"), "batch/n1": Victim("batch/n1", 10, "offline")}
    c = choose(
        s.nodes.values(), Preemptor(PodRequest("web/a", "online", (ContainerRequest("main", 1),)), 100), pods
    )
    assert c is not None and c.victims == ("batch/n1",)


def test_offline_before_online_of_the_same_priority() -> None:
    s = cluster(2, 1)
    assert put(s, "a/on", "online", (ContainerRequest("main", 1),), "n0")
    assert put(s, "a/off", "offline", (ContainerRequest("main", 1),), "n1")
    pods = {"a/on": Victim("a/on", 10, "online"), "a/off": Victim("a/off", 10, "offline")}
    c = choose(
        s.nodes.values(), Preemptor(PodRequest("web/a", "online", (ContainerRequest("main", 1),)), 100), pods
    )
    assert c is not None and c.victims == ("a/off",)


def test_multi_gpu_and_init_container_counted_as_fit_counts_them() -> None:
    s = cluster(1, 4)
    for i in range(4):
        assert put(s, f"batch/o{i}", "offline", (share(50000, 20),), "n0")  # one a GPU
    pods = {k: Victim(k, 1, "offline") for k in s.pods}
    pod = PodRequest(
        "web/a",
        "online",
        (share(30000, 30, gpus=2),),
        init_containers=(ContainerRequest("init", 2, 70000, 100, True),),
    )
    c = choose(s.nodes.values(), Preemptor(pod, 100), pods)
    assert c is not None and len(c.victims) == 2


# --- properties ------------------------------------------------------------------------------

shape = st.one_of(
    st.builds(lambda g: (ContainerRequest("main", g),), st.integers(1, 2)),
    st.builds(
        lambda g, m, k: (share(m, k, g),),
        st.integers(1, 2),
        st.sampled_from([10000, 20000, 30000, 40000]),
        st.integers(5, 60),
    ),
)
running = st.lists(
    st.tuples(
        st.sampled_from(["online", "offline"]),
        shape,
        st.sampled_from([0, 10, 100, 1000, SYSTEM_PRIORITY]),
        st.booleans(),  # covered by an exhausted budget
        st.integers(0, 1),  # node
    ),
    max_size=7,
)


def scene(rows: list) -> tuple[ClusterState, dict[str, Victim]]:
    s = cluster(2, 2)
    pods = {}
    for i, (cls, cs, prio, protected, n) in enumerate(rows):
        key = f"ns/p{i}"
        if put(s, key, cls, cs, f"n{n}"):
            pods[key] = Victim(key, prio, cls, ("pdb",) if protected else ())
    return s, pods


def fits_after(node: Node, pod: PodRequest, victims: set[str]) -> bool:
    return isinstance(fit(without(node, victims), pod), Fit)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    running,
    st.sampled_from(["online", "offline"]),
    shape,
    st.sampled_from([0, 10, 100, 1000, 2 * SYSTEM_PRIORITY]),
    st.booleans(),
)
def test_choice_obeys_the_rules(rows: list, cls: str, cs: tuple, prio: int, never: bool) -> None:
    s, pods = scene(rows)
    pre = Preemptor(PodRequest("ns/pre", cls, cs), prio, may_preempt=not never)
    c = choose(s.nodes.values(), pre, pods, {"pdb": 0})
    nodes = list(s.nodes.values())
    fits_now = any(isinstance(fit(n, pre.pod), Fit) for n in nodes)
    # complete: it finds a choice exactly when evicting every pod it may evict makes room somewhere
    eligible = {k for k, v in pods.items() if may_evict(pre, v)}
    possible = fits_now or any(fits_after(n, pre.pod, eligible) for n in nodes)
    assert (c is not None) == possible
    if c is None:
        return
    node = s.nodes[c.node]
    if fits_now:
        assert c.victims == ()
        return
    for k in c.victims:  # only strictly lower, non-system priorities; never with Never
        v = pods[k]
        assert not never and v.priority < prio and v.priority < SYSTEM_PRIORITY
        assert any(k in g.holders for g in node.gpus)
    # the pod then fits there, with no over-commit and no class mix
    after = s.clone()
    for k in c.victims:
        after.release(k)
    after.place(pre.pod, c.fit.placement, c.fit.charged)
    assert invariant_violations(after) == []
    # minimal: sparing any one victim leaves no room on that node
    for k in c.victims:
        assert not fits_after(node, pre.pod, set(c.victims) - {k})
    # never violates a budget when a choice without a violation exists (brute force)
    if c.budget_violations:
        free = [k for k in eligible if not pods[k].budgets]
        for n in nodes:
            on = [k for k in free if any(k in g.holders for g in n.gpus)]
            assert not fits_after(n, pre.pod, set(on))


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(running, st.sampled_from(["online", "offline"]), shape)
def test_no_smaller_choice_of_the_same_or_lower_priorities_exists(rows: list, cls: str, cs: tuple) -> None:
    """Fewest and lowest: no subset of lower-priority pods, all of priority at most the chosen
    ones' highest, makes room with fewer victims (brute force over up to 7 pods)."""
    s, pods = scene(rows)
    pods = {k: v for k, v in pods.items() if not v.budgets}
    pre = Preemptor(PodRequest("ns/pre", cls, cs), 10**6)
    c = choose(s.nodes.values(), pre, pods)
    if c is None or not c.victims:
        return
    top = max(pods[k].priority for k in c.victims)
    for n in s.nodes.values():
        on = [k for k, v in pods.items() if v.priority <= top and any(k in g.holders for g in n.gpus)]
        for size in range(len(c.victims) - 1, 0, -1):
            for sub in itertools.combinations(on, size):
                if fits_after(n, pre.pod, set(sub)):
                    pytest.fail(f"{sub} on {n.name} is smaller than {c.victims} on {c.node}")


def test_budget_violations_count_in_order() -> None:
    vs = [Victim("a", budgets=("b",)), Victim("b", budgets=("b",)), Victim("c")]
    assert budget_violations(vs, {"b": 1}) == 1
    assert budget_violations(vs, {}) == 2


# --- host room: CPU, memory and pod slots ------------------------------------------------------

CPU = 8000


def host_cluster(nodes: int, gpus: int) -> ClusterState:
    s = ClusterState()
    for n in range(nodes):
        gs = [GPU(f"G-{n}-{i}", i, "H100", MIB) for i in range(gpus)]
        s.add_node(Node(f"n{n}", gs, cpu_milli=CPU, ram_mib=64000))
    return s


def host_put(s: ClusterState, key: str, cls: str, cs: tuple, cpu: int, node: str) -> bool:
    pod = PodRequest(key, cls, cs, cpu_milli=cpu)
    f = fit(s.nodes[node], pod)
    if not isinstance(f, Fit):
        return False
    s.place(pod, f.placement, f.charged)
    return True


def test_cpu_only_preemptor_evicts_a_cpu_only_pod() -> None:
    s = host_cluster(1, 1)
    assert host_put(s, "batch/cruncher", "offline", (), 6000, "n0")
    pods = {"batch/cruncher": Victim("batch/cruncher", 100, "offline", cpu_milli=6000, node="n0")}
    pre = Preemptor(PodRequest("web/api", "online", (), cpu_milli=4000), 1000)
    c = choose(s.nodes.values(), pre, pods)
    assert c is not None and c.victims == ("batch/cruncher",)


def test_gpu_pod_short_of_cpu_also_evicts_a_cpu_only_pod() -> None:
    # the GPU is free, the CPU is not: the lower-priority CPU-only pod goes, nothing else
    s = host_cluster(1, 2)
    assert host_put(s, "batch/cpu", "offline", (), 7000, "n0")
    assert host_put(s, "batch/gpu", "offline", (share(20000, 20),), 500, "n0")
    pods = {
        "batch/cpu": Victim("batch/cpu", 100, "offline", cpu_milli=7000, node="n0"),
        "batch/gpu": Victim("batch/gpu", 100, "offline", cpu_milli=500),
    }
    pre = Preemptor(PodRequest("web/a", "online", (share(40000, 40),), cpu_milli=2000), 1000)
    c = choose(s.nodes.values(), pre, pods)
    assert c is not None and c.victims == ("batch/cpu",)


def test_pod_slots_count() -> None:
    # room on the GPU, none in the pod slots: one pod must go, the cheapest
    s = host_cluster(1, 2)
    assert host_put(s, "batch/a", "offline", (share(20000, 20),), 100, "n0")
    assert host_put(s, "batch/b", "offline", (), 100, "n0")
    pods = {
        "batch/a": Victim("batch/a", 100, "offline", cpu_milli=100),
        "batch/b": Victim("batch/b", 50, "offline", cpu_milli=100, node="n0"),
    }
    pre = Preemptor(PodRequest("web/a", "online", (share(20000, 20),), cpu_milli=100), 1000)
    assert choose(s.nodes.values(), pre, pods, pod_room={"n0": 1}).victims == ()  # type: ignore[union-attr]
    c = choose(s.nodes.values(), pre, pods, pod_room={"n0": 0})
    assert c is not None and c.victims == ("batch/b",)
    # and no eviction helps a node that would still be full
    assert choose(s.nodes.values(), pre, {}, pod_room={"n0": 0}) is None


host_rows = st.lists(
    st.tuples(
        st.sampled_from(["online", "offline"]),
        st.one_of(st.just(()), shape),  # () = a pod holding no GPU
        st.sampled_from([0, 10, 100, 1000]),
        st.sampled_from([0, 1000, 3000, 5000]),  # CPU milli
        st.integers(0, 1),  # node
    ),
    max_size=7,
)


def host_scene(rows: list) -> tuple[ClusterState, dict[str, Victim]]:
    s = host_cluster(2, 2)
    pods = {}
    for i, (cls, cs, prio, cpu, n) in enumerate(rows):
        key = f"ns/p{i}"
        if host_put(s, key, cls, cs, cpu, f"n{n}"):
            pods[key] = Victim(key, prio, cls, cpu_milli=cpu, node="" if cs else f"n{n}")
    return s, pods


def host_fits_after(
    s: ClusterState, n: Node, pod: PodRequest, victims: set[str], pods: dict, room: dict
) -> bool:
    if room[n.name] + len(victims) < 1:
        return False
    return isinstance(fit(without(n, victims, pods), pod), Fit)


def on_node(s: ClusterState, n: Node, k: str) -> bool:
    return s.pods[k][1].node == n.name


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    host_rows,
    st.sampled_from(["online", "offline"]),
    st.one_of(st.just(()), shape),
    st.sampled_from([0, 2000, 6000]),
    st.sampled_from([10, 1000, 10**6]),
    st.tuples(st.integers(0, 3), st.integers(0, 3)),
)
def test_host_room_choice_is_complete_safe_and_minimal(
    rows: list, cls: str, cs: tuple, cpu: int, prio: int, slots: tuple[int, int]
) -> None:
    s, pods = host_scene(rows)
    counts = {n: sum(1 for p in s.pods.values() if p[1].node == n) for n in s.nodes}
    room = {n: max(0, slots[i] + 1 - counts[n]) if slots[i] else 0 for i, n in enumerate(sorted(s.nodes))}
    pre = Preemptor(PodRequest("ns/pre", cls, cs, cpu_milli=cpu), prio)
    c = choose(s.nodes.values(), pre, pods, pod_room=room)
    nodes = list(s.nodes.values())
    eligible = {k for k, v in pods.items() if may_evict(pre, v)}
    possible = any(
        host_fits_after(s, n, pre.pod, {k for k in eligible if on_node(s, n, k)}, pods, room) for n in nodes
    ) or any(host_fits_after(s, n, pre.pod, set(), pods, room) for n in nodes)
    assert (c is not None) == possible
    if c is None:
        return
    node = s.nodes[c.node]
    assert all(k in eligible and on_node(s, node, k) for k in c.victims)
    assert host_fits_after(s, node, pre.pod, set(c.victims), pods, room)
    after = s.clone()
    for k in c.victims:
        after.release(k)
    after.place(pre.pod, c.fit.placement, c.fit.charged)  # raises on CPU or GPU over-commit
    assert invariant_violations(after) == []
    for k in c.victims:
        assert not host_fits_after(s, node, pre.pod, set(c.victims) - {k}, pods, room)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(host_rows, st.lists(st.tuples(st.sampled_from(["online", "offline"]), shape), min_size=1, max_size=4))
def test_memo_gives_the_same_choices(rows: list, wanting: list) -> None:
    """A pass that keeps a memo and replaces the nodes it changes answers as one without."""
    s, pods = host_scene(rows)
    memo: dict = {}
    nodes = dict(s.nodes)
    for i, (cls, cs) in enumerate(wanting):
        pre = Preemptor(PodRequest(f"ns/pre{i}", cls, cs), 10**6)
        plain = choose(nodes.values(), pre, pods)
        remembered = choose(nodes.values(), pre, pods, memo=memo)
        assert plain == remembered
        if plain is None:
            continue
        n = without(nodes[plain.node], plain.victims, pods)
        for g, (mem, milli, ex) in plain.fit.charged.items():
            n.gpus[g].charge(pre.pod.key, mem, milli, ex, cls)
        nodes[plain.node] = n
        for k in plain.victims:
            pods.pop(k)


def test_cpu_only_preemptor_on_a_node_without_gpus() -> None:
    n = Node("cpu", [], cpu_milli=8000, ram_mib=1000, cpu_used=8000)
    pods = {
        "x/big": Victim("x/big", 1, cpu_milli=6000, node="cpu"),
        "x/small": Victim("x/small", 1, cpu_milli=2000, node="cpu"),
        "x/high": Victim("x/high", 10**6, cpu_milli=8000, node="cpu"),
    }
    c = choose([n], Preemptor(PodRequest("a/web", cpu_milli=2000), 100), pods)
    assert c is not None and c.victims == ("x/small",)
    # a GPU pod never goes to a node without GPUs, whatever is evicted
    assert choose([n], Preemptor(PodRequest("a/gpu", containers=(share(1000, 10),)), 100), pods) is None


def test_no_eviction_where_the_policy_would_still_refuse_the_pod() -> None:
    """A pod asking for no GPU, whose CPU the gpupack policy keeps for free GPUs: evicting a
    CPU-only pod on "dense" frees CPU that its idle GPUs need (the pod is still refused there), so
    with the policy's refusal the chooser evicts on "roomy", whose CPU is to spare once freed."""
    from gpupack.core.policies import get_policy
    from gpupack.core.workload import Shape, Workload

    policy = get_policy("gpupack", workload=Workload.of([Shape(12000, 1, 1000)] * 10))  # 12 cores a GPU
    dense = Node("dense", [GPU(f"D-{i}", i, "H100", MIB) for i in range(8)], cpu_milli=96000, ram_mib=10**6)
    roomy = Node("roomy", [GPU(f"R-{i}", i, "H100", MIB) for i in range(2)], cpu_milli=40000, ram_mib=10**6)
    dense.cpu_used, roomy.cpu_used = 96000, 40000
    pods = {
        "batch/d": Victim("batch/d", 1, "offline", cpu_milli=96000, node="dense"),
        "batch/r": Victim("batch/r", 5, "offline", cpu_milli=40000, node="roomy"),
    }
    pre = Preemptor(PodRequest("web/cpu", "online", (), cpu_milli=8000), 1000)
    # without the refusal, the lower-priority victim on dense goes, for nothing
    plain = choose([dense, roomy], pre, pods)
    assert plain is not None and plain.node == "dense" and plain.victims == ("batch/d",)
    kept = choose([dense, roomy], pre, pods, admit=policy.refuses)
    assert kept is not None and kept.node == "roomy" and kept.victims == ("batch/r",)
    assert policy.refuses(without(roomy, kept.victims, pods), pre.pod) is None
    assert policy.refuses(without(dense, ("batch/d",), pods), pre.pod) is not None
    # and none at all where every node would still refuse it
    assert choose([dense], pre, pods, admit=policy.refuses) is None
