"""fgd and gpupack as the extender uses them: get_policy, fit, node_score, schedule."""

import subprocess
import sys

import pytest

from gpupack.core.fit import Fit
from gpupack.core.model import GPU, ClusterState, ContainerRequest, Node, PodRequest
from gpupack.core.policies import DEFAULT_POLICY, POLICIES, UnknownPolicy, get_policy, schedule
from gpupack.core.workload import Shape, Workload


def node(name, n=4, model="A10", mem=24576, cpu=0):
    return Node(
        name,
        [GPU(f"{name}-{i}", i, model, mem) for i in range(n)],
        cpu_milli=cpu,
        ram_mib=10**6 if cpu else 0,
    )


def pod(key, milli=None, mem=None, gpus=1, cls="online", cpu=0):
    cs = (ContainerRequest("c", gpus, mem, milli),) if gpus else ()
    return PodRequest(key, cls, cs, cpu_milli=cpu)


def test_registry_and_default():
    assert DEFAULT_POLICY == "gpupack"
    p = get_policy("gpupack")
    assert p.name == "gpupack" and {"random", "bestfit", "fgd", "gpupack"} <= set(POLICIES)
    with pytest.raises(
        UnknownPolicy, match="unknown policy 'nope'; choose one of bestfit, fgd, gpupack, random"
    ):
        get_policy("nope")


@pytest.mark.parametrize(
    "first", ["gpupack.core.gpupack_policy", "gpupack.core.policies", "gpupack.core.policy_base"]
)
def test_registry_has_no_import_cycle(first):
    """Whichever policy module is imported first, the registry lists every policy, and the default
    policy's module builds on the base without importing the registry (no circular import)."""
    code = (
        f"import sys, importlib; importlib.import_module({first!r}); "
        "import gpupack.core.gpupack_policy as g; "
        "assert ('gpupack.core.policies' in sys.modules) == (sys.argv[1] == 'gpupack.core.policies'); "
        "from gpupack.core.policies import POLICIES, get_policy; "
        "assert POLICIES['gpupack'].factory is g.GpupackPolicy and type(get_policy('gpupack')) is g.GpupackPolicy; "
        "print(sorted(POLICIES))"
    )
    out = subprocess.run([sys.executable, "-c", code, first], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['bestfit',", "'fgd',", "'gpupack',", "'random']"]


@pytest.mark.parametrize("name", ["fgd", "gpupack"])
def test_sharing_pod_fills_the_hole_it_fits_instead_of_opening_a_gpu(name):
    # Typical pods take 500 milli; a GPU with 500 free is their perfect home.
    wl = Workload.of([Shape(0, 1, 500)] * 10)
    p = get_policy(name, workload=wl)
    st = ClusterState()
    st.add_node(node("a", 2))
    st.add_node(node("b", 2))
    first = schedule(st, pod("ns/1", milli=500), p)
    second = schedule(st, pod("ns/2", milli=500), p)
    assert second.node == first.node
    assert (
        second.fit.placement.containers["c"][0].gpu_index == first.fit.placement.containers["c"][0].gpu_index
    )


def test_fgd_scores_integer_and_prefers_less_fragmentation():
    wl = Workload.of([Shape(0, 1, 1000)] * 5 + [Shape(0, 1, 600)] * 5)
    p = get_policy("fgd", workload=wl)
    empty, used = node("e", 2), node("u", 2)
    st = ClusterState()
    st.add_node(empty)
    st.add_node(used)
    schedule(st, pod("ns/x", milli=400), p)  # lands somewhere; make 'u' the used one explicitly
    st = ClusterState()
    st.add_node(empty := node("e", 2))
    st.add_node(used := node("u", 2))
    f = p.fit(used, pod("ns/y", milli=600))
    st.place(pod("ns/y", milli=600), f.placement, f.charged)
    q = pod("ns/z", milli=400)
    s_used = p.node_score(used, q, p.fit(used, q))
    s_empty = p.node_score(empty, q, p.fit(empty, q))
    assert float(s_used).is_integer() and 0 <= s_used <= 100
    assert s_used > s_empty  # 400 next to the 600 fills a GPU; on the empty node it spoils one


def test_gpupack_keeps_classes_apart_and_respects_memory():
    p = get_policy("gpupack")
    st = ClusterState()
    st.add_node(node("a", 1, mem=24576))
    st.add_node(node("b", 1, mem=24576))
    d1 = schedule(st, pod("ns/on", mem=8000, milli=300, cls="online"), p)
    d2 = schedule(st, pod("ns/off", mem=8000, milli=300, cls="offline"), p)
    assert d1.placed and d2.placed and d1.node != d2.node
    d3 = schedule(st, pod("ns/big", mem=20000, milli=100, cls="online"), p)
    assert not d3.placed and {f.code for f in d3.failures.values()} <= {"gpu-mem", "class"}


def test_gpupack_learns_the_workload_from_observed_pods():
    p = get_policy("gpupack")
    for i in range(20):
        p.observe(pod(f"ns/{i}", mem=12000, milli=500))
    shapes, weights = p.workload.typical()
    assert shapes == (Shape(0, 1, 500, 12000, None, "online"),) and weights == (20,)


def test_gpupack_steers_cpu_only_pods_away_from_gpu_dense_nodes():
    # Workload: whole-GPU pods needing 12 cores each. A CPU-only pod on the 8-GPU node with 96 cores
    # would strand GPUs there; the 2-GPU node has CPU to spare.
    wl = Workload.of([Shape(12000, 1, 1000)] * 10 + [Shape(8000, 0, 0)] * 3)
    st = ClusterState()
    st.add_node(node("dense", 8, cpu=96000))
    st.add_node(node("cpu-rich", 2, cpu=104000))
    for seed in range(5):
        p = get_policy("gpupack", seed=seed, workload=wl)
        d = schedule(st, pod(f"ns/cpu{seed}", gpus=0, cpu=16000), p, commit=False)
        assert d.node == "cpu-rich"
    # fgd sees no difference until CPU runs out: both nodes tie and the seeded order decides.
    picks = {
        schedule(
            st, pod("ns/c", gpus=0, cpu=16000), get_policy("fgd", seed=s, workload=wl), commit=False
        ).node
        for s in range(8)
    }
    assert picks == {"dense", "cpu-rich"}


def test_whole_gpu_pod_gets_idle_gpus_in_index_order():
    for name in ("fgd", "gpupack"):
        p = get_policy(name, workload=Workload.of([Shape(0, 1, 1000)]))
        n = node("a", 4)
        f = p.fit(n, pod("ns/w", gpus=2))
        assert isinstance(f, Fit) and sorted(f.charged) == [0, 1]


def test_gpupack_charges_added_stranding_and_rewards_removing_it_only_where_allowed():
    from gpupack.core.gpupack_policy import gain

    assert gain((100, 1600), (100, 800), 10, reward=False) == 0  # stranding removed: no reward
    assert gain((100, 1600), (100, 800), 10, reward=True) == 8000  # ... unless the node allows it
    for reward in (False, True):
        assert gain((100, 0), (100, 200), 10, reward) == -2000  # stranding added: charged
        assert gain((500, 0), (300, 0), 10, reward) == 200  # fragmentation removed counts as before
    # A CPU-poor node (1 core for 2 GPUs, the workload runs 1 core per GPU) strands a GPU from the
    # start; a GPU pod there removes that stranding but must not score above a CPU-rich node.
    wl = Workload.of([Shape(1000, 1, 1000)] * 4)
    p = get_policy("gpupack", workload=wl)
    poor, rich = node("poor", 2, cpu=1000), node("rich", 2, cpu=100_000)
    q = pod("ns/q", gpus=1)
    assert p.node_score(poor, q, p.fit(poor, q)) == p.node_score(rich, q, p.fit(rich, q))


def test_gpupack_puts_a_cpu_light_gpu_pod_on_gpus_whose_cpu_others_ate():
    from gpupack.core.gpupack_policy import rewards_unstranding

    # The workload runs 1 core per GPU. "eaten" could feed both its GPUs, but a CPU-only pod took 3
    # of its 4 cores: one GPU there is stranded until a CPU-light GPU pod takes it.
    wl = Workload.of([Shape(1000, 1, 1000)] * 4 + [Shape(3000, 0, 0)])
    st = ClusterState()
    st.add_node(node("eaten", 2, cpu=4000))
    st.add_node(node("fresh", 2, cpu=4000))
    eaten = st.nodes["eaten"]
    eaten.cpu_used = 3000
    light = pod("ns/light", gpus=1, cpu=0)
    for seed in range(5):
        assert (
            schedule(st, light, get_policy("gpupack", seed=seed, workload=wl), commit=False).node == "eaten"
        )
    # Where a model-constrained typical shape may use the model, a pod constrained to it would take
    # that GPU later: no reward, the two nodes score alike.
    a10_only = Shape(1000, 1, 1000, models=frozenset({"A10"}), spec="A10")
    p = get_policy("gpupack", workload=Workload.of([Shape(1000, 1, 1000)] * 4 + [a10_only] * 2))
    fresh = st.nodes["fresh"]
    assert p.node_score(eaten, light, p.fit(eaten, light)) == p.node_score(fresh, light, p.fit(fresh, light))
    assert rewards_unstranding(4000, 2000, "A10", (1, 1), frozenset())
    assert not rewards_unstranding(4000, 2000, "A10", (1, 1), frozenset({"A10"}))
    assert not rewards_unstranding(1999, 2000, "T4", (1, 1), frozenset())  # CPU-poor: never feeds both
    assert not rewards_unstranding(4000, 2000, "T4", (0, 0), frozenset())  # no GPU pod seen yet


def test_waste_table_is_what_typical_pods_cannot_fill():
    from gpupack.core.gpupack_policy import waste_table

    phi = waste_table([Shape(0, 1, 600), Shape(0, 1, 300), Shape(0, 0, 0)], [1, 1, 5])
    assert phi[0] == 0 and phi[299] == 299  # nothing fits: all of it is waste
    assert phi[300] == 0 and phi[600] == 0  # one 300 pod, or two, fill it exactly
    # 900 free: a 600 pod (300 left, then a 300 pod) or a 300 pod (600 left: either fills it).
    assert phi[900] == 0
    # 800 free: 600 leaves 200 (waste); 300 leaves 500, then 300 leaves 200 (waste): always 200.
    assert phi[800] == 200
    # 1000 free: 600 → 400 → 300 → 100 wasted; 300 → 700: 600 → 100, or 300 → 400 → 300 → 100.
    assert phi[1000] == 100


def _keep_case():
    # The GPU pods seen ask 12 cores per GPU. "dense": 8 idle GPUs and 96 cores, exactly what its
    # GPUs need; "roomy": 2 idle GPUs and 40 cores, 16 to spare.
    wl = Workload.of([Shape(12000, 1, 1000)] * 10)
    return wl, node("dense", 8, cpu=96000), node("roomy", 2, cpu=40000)


@pytest.mark.parametrize(
    ("where", "cpu", "refused"),
    [
        ("dense", 1, True),  # one millicore there already leaves a GPU short of its CPU
        ("roomy", 16000, False),  # what the node has to spare beyond its GPUs' needs
        ("roomy", 16001, True),  # a millicore more strands GPU capacity
    ],
)
def test_gpupack_keeps_a_nodes_cpu_for_its_free_gpus(where, cpu, refused):
    wl, dense, roomy = _keep_case()
    n = {"dense": dense, "roomy": roomy}[where]
    p = get_policy("gpupack", workload=wl)
    r = p.fit(n, pod("ns/c", gpus=0, cpu=cpu))
    if refused:
        assert not r and r.code == "cpu-kept-for-gpus" and r.unresolvable
        assert f"node {where}: its free CPU is kept for its free GPUs" in r.reason and "12000m" in r.reason
        assert p.refuses(n, pod("ns/c", gpus=0, cpu=cpu)) == r
    else:
        assert isinstance(r, Fit) and not r.charged and p.refuses(n, pod("ns/c", gpus=0, cpu=cpu)) is None
    # switched off, or a policy that has seen no GPU pod: nothing is kept
    off = get_policy("gpupack", workload=wl, keep_cpu_for_gpus=False)
    assert isinstance(off.fit(n, pod("ns/c", gpus=0, cpu=cpu)), Fit)
    learner = get_policy("gpupack")
    learner.observe(pod("ns/cpu-only", gpus=0, cpu=4000))
    assert isinstance(learner.fit(n, pod("ns/c", gpus=0, cpu=cpu)), Fit)


def test_gpupack_keeps_cpu_only_for_free_gpus_and_never_refuses_a_gpu_pod():
    wl, dense, _ = _keep_case()
    p = get_policy("gpupack", workload=wl)
    # GPU pods are never refused by the rule: they are what the CPU is kept for
    assert isinstance(p.fit(dense, pod("ns/g", gpus=1, cpu=12000)), Fit)
    # the CPU of GPUs already taken is nobody's to keep: with 4 of the 8 GPUs held, 48 cores serve
    # the other 4 and the rest goes to pods asking for no GPU
    for g in dense.gpus[:4]:
        g.charge(f"ns/w{g.index}", g.mem_mib, 1000, True, "online")
    dense.cpu_used = 12000 * 4
    assert isinstance(p.fit(dense, pod("ns/c", gpus=0, cpu=0)), Fit)
    assert not p.fit(dense, pod("ns/c", gpus=0, cpu=1))
    dense.cpu_used = 12000 * 2  # GPU pods that asked for less CPU left 24 cores to spare
    assert isinstance(p.fit(dense, pod("ns/c", gpus=0, cpu=24000)), Fit)
    assert not p.fit(dense, pod("ns/c", gpus=0, cpu=24001))
