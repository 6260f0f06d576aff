"""gpupack.core.node_rules: kube-scheduler's required node rules and host-resource fit over plain
dicts, table by table, and what a hostile spec gets (a reason, never an exception)."""

from __future__ import annotations

import pytest

from gpupack.core.node_rules import (
    HostNeeds,
    NodeFacts,
    expression_holds,
    host_needs,
    host_refusal,
    node_facts,
    pod_terms,
    refusal,
    tolerates,
)

LABELS = {"gpu": "h100", "zone": "a", "gen": "9", "big": "99999999999999999999"}
GIB = 1 << 30


@pytest.mark.parametrize(
    "op, key, values, holds",
    [
        ("In", "gpu", ["a100", "h100"], True),
        ("In", "gpu", ["a100"], False),
        ("In", "absent", ["x"], False),
        ("NotIn", "gpu", ["a100"], True),
        ("NotIn", "gpu", ["h100"], False),
        ("NotIn", "absent", ["x"], True),  # an absent label is not in any set
        ("Exists", "zone", [], True),
        ("Exists", "absent", [], False),
        ("DoesNotExist", "absent", [], True),
        ("DoesNotExist", "zone", [], False),
        ("Gt", "gen", ["8"], True),
        ("Gt", "gen", ["9"], False),
        ("Lt", "gen", ["10"], True),
        ("Lt", "gen", ["9"], False),
        ("Gt", "gen", ["-1"], True),
        ("Gt", "zone", ["1"], False),  # the label is no integer
        ("Gt", "gen", ["x"], False),  # the operand is no integer
        ("Gt", "gen", ["1", "2"], False),  # exactly one operand
        ("Gt", "big", ["1"], False),  # beyond int64, as the scheduler's ParseInt
        ("Lt", "absent", ["1"], False),
        ("Gt", "gen", ["1" * 5000], False),  # a huge operand costs nothing
        ("Near", "gpu", ["h100"], False),  # an unknown operator never holds
    ],
)
def test_each_operator(op, key, values, holds):
    assert expression_holds({"key": key, "operator": op, "values": values}, LABELS) is holds


@pytest.mark.parametrize(
    "tol, taint, ok",
    [
        ({"key": "gpu", "operator": "Equal", "value": "x", "effect": "NoSchedule"}, ("gpu", "x", "NoSchedule"), True),
        ({"key": "gpu", "value": "x"}, ("gpu", "x", "NoExecute"), True),  # Equal by default, every effect
        ({"key": "gpu", "value": "y"}, ("gpu", "x", "NoSchedule"), False),
        ({"key": "gpu", "operator": "Exists"}, ("gpu", "x", "NoSchedule"), True),
        ({"key": "gpu", "operator": "Exists", "effect": "NoExecute"}, ("gpu", "x", "NoSchedule"), False),
        ({"operator": "Exists"}, ("anything", "v", "NoExecute"), True),  # empty key + Exists: all
        ({"operator": "Equal", "value": "v"}, ("anything", "v", "NoSchedule"), False),  # empty key + Equal: no key
        ({"key": "other", "operator": "Exists"}, ("gpu", "x", "NoSchedule"), False),
        ({"key": "gpu", "operator": "Sometimes"}, ("gpu", "x", "NoSchedule"), False),
    ],
)  # fmt: skip
def test_tolerations(tol, taint, ok):
    assert tolerates(tol, {"key": taint[0], "value": taint[1], "effect": taint[2]}) is ok


def facts(**kw) -> NodeFacts:
    base = {"labels": LABELS, "cpu_milli": 96000, "mem_bytes": 512 * GIB, "pods": 110}
    return NodeFacts(**{**base, **kw})


@pytest.mark.parametrize(
    "spec, reason",
    [
        ({}, None),
        ({"nodeSelector": {"gpu": "h100"}}, None),
        ({"nodeSelector": {"gpu": "a100"}}, "nodeSelector gpu=a100 not in template labels"),
        ({"nodeSelector": {"pool": "x"}}, "nodeSelector pool=x not in template labels"),
        # required affinity: terms are ORed, a term's requirements ANDed
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]},
            {"matchExpressions": [{"key": "zone", "operator": "Exists"}, {"key": "gen", "operator": "Gt", "values": ["8"]}]},
        ]}}}}, None),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "Exists"}, {"key": "gen", "operator": "Lt", "values": ["8"]}]},
        ]}}}}, "required node affinity: none of its 1 term(s)"),
        # matchFields names a node; a node not yet made has no name
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}}}, "required node affinity"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}},
         "required node affinity"),  # an empty term matches nothing
        # preferred terms never keep a pod off
        ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}}]}}}, None),
    ],
)  # fmt: skip
def test_selector_and_required_affinity(spec, reason):
    got = refusal(pod_terms(spec), facts())
    assert (got is None) if reason is None else (got is not None and got.startswith(reason)), got


def test_match_fields_hold_on_an_existing_node_of_that_name():
    spec = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}}}  # fmt: skip
    assert refusal(pod_terms(spec), facts(name="n1"), "node") is None
    assert refusal(pod_terms(spec), facts(name="n2"), "node") is not None


TAINTS = (
    {"key": "gpu", "value": "reserved", "effect": "NoSchedule"},
    {"key": "maint", "effect": "NoExecute"},
    {"key": "soft", "effect": "PreferNoSchedule"},  # ignored: it never keeps a pod off
)


@pytest.mark.parametrize(
    "tols, reason",
    [
        ([], "taint gpu=reserved:NoSchedule not tolerated"),
        ([{"key": "gpu", "value": "reserved", "effect": "NoSchedule"}], "taint maint:NoExecute not tolerated"),
        ([{"key": "gpu", "operator": "Exists"}, {"key": "maint", "operator": "Exists", "effect": "NoExecute"}], None),
        ([{"operator": "Exists"}], None),
        ([{"key": "gpu", "value": "other"}, {"key": "maint", "operator": "Exists"}], "taint gpu=reserved"),
    ],
)  # fmt: skip
def test_tolerations_against_a_templates_taints(tols, reason):
    got = refusal(pod_terms({"tolerations": tols}), facts(taints=TAINTS))
    assert (got is None) if reason is None else (got is not None and got.startswith(reason)), got


def container(name: str, cpu: str | None = None, mem: str | None = None, **kw) -> dict:
    req = {k: v for k, v in (("cpu", cpu), ("memory", mem)) if v is not None}
    return {"name": name, "resources": {"requests": req}, **kw}


@pytest.mark.parametrize(
    "spec, cpu, mem",
    [
        ({"containers": [container("a", "1", "1Gi"), container("b", "500m", "512Mi")]}, 1500, GIB + GIB // 2),
        # an init container larger than the app containers sets the pod's request
        ({"containers": [container("a", "1")], "initContainers": [container("i", "4")]}, 4000, 0),
        # a sidecar (restartable init container) adds to the app containers and to later inits
        ({"containers": [container("a", "1")],
          "initContainers": [container("s", "2", restartPolicy="Always"), container("i", "2")]}, 4000, 0),
        ({"containers": [container("a", "1")], "overhead": {"cpu": "250m", "memory": "64Mi"}}, 1250, 64 << 20),
        ({"containers": [container("a", "0.0001")]}, 1, 0),  # rounded up to a milli-CPU
    ],
)  # fmt: skip
def test_host_needs_are_the_schedulers_sum(spec, cpu, mem):
    n = host_needs(spec)
    assert (n.cpu_milli, n.mem_bytes, n.pods) == (cpu, mem, 1)


@pytest.mark.parametrize(
    "needs, reason",
    [
        (HostNeeds(96000, 0), None),
        (HostNeeds(1000 * 1000, 0), "needs 1000 CPUs, a node has 96 CPUs"),
        (HostNeeds(96001, 0), "needs 96001m CPU, a node has 96 CPUs"),
        (HostNeeds(0, 513 * GIB), "needs 513.0 GiB of memory, a node has 512.0 GiB"),
        (HostNeeds(0, 0, 111), "a node takes 110 pods"),
        (HostNeeds(10**50, 10**50), "needs "),  # a huge request is just too big, nothing overflows
    ],
)
def test_host_resources_against_the_templates_allocatable(needs, reason):
    got = host_refusal(needs, facts())
    assert (got is None) if reason is None else (got is not None and got.startswith(reason)), got


def test_unknown_allocatable_is_not_checked():
    assert host_refusal(HostNeeds(10**9, 10**15, 10**6), NodeFacts()) is None


@pytest.mark.parametrize(
    "spec, says",
    [
        ({"containers": [container("a", "lots")]}, "'a' cpu request"),
        ({"containers": [container("a", mem="1e400")]}, "memory request"),
        ({"containers": [container("a", "9" * 5000)]}, "longer than"),
        ({"containers": [container("a", "-1")]}, "negative"),
        ({"containers": [container("a", cpu=True)]}, "boolean"),
        ({"overhead": {"cpu": "x"}}, "overhead cpu"),
    ],
)
def test_a_malformed_request_means_cannot_place_with_the_reason(spec, says):
    t = pod_terms(spec)
    assert t.problem is not None and t.problem.startswith("cannot place") and says in t.problem, t.problem
    assert refusal(t, facts()) == t.problem


@pytest.mark.parametrize(
    "spec",
    [
        None,
        "a string",
        {"nodeSelector": "x", "tolerations": "y", "affinity": [1]},
        {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": "no"}}},
        {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": 5, "operator": "In", "values": "x"}, None]}]}}}},
        {"tolerations": [None, 3, {"key": 1, "operator": ["Exists"]}], "containers": [None, {"resources": 7}]},
    ],
)  # fmt: skip
def test_a_hostile_spec_gets_a_reason_or_none_never_an_exception(spec):
    t = pod_terms(spec)
    r = refusal(t, facts(taints=TAINTS))
    assert r is None or isinstance(r, str)


def test_reasons_quote_a_short_prefix_of_what_the_tenant_wrote():
    r = refusal(pod_terms({"nodeSelector": {"k" * 300: "v" * 300}}), facts())
    assert r is not None and len(r) < 150


def test_node_facts_from_a_node_object():
    node = {
        "metadata": {"name": "n1", "labels": {"a": "b"}},
        "spec": {"taints": [{"key": "t", "effect": "NoSchedule"}]},
        "status": {
            "allocatable": {"cpu": "95500m", "memory": "16Gi", "pods": "110", "ephemeral-storage": "x"}
        },
    }
    f = node_facts(node)
    assert (f.name, dict(f.labels), f.cpu_milli, f.mem_bytes, f.pods) == (
        "n1",
        {"a": "b"},
        95500,
        16 * GIB,
        110,
    )
    assert f.taints == ({"key": "t", "effect": "NoSchedule"},)
    bad = node_facts({"status": {"allocatable": {"cpu": "lots"}}}, with_name=False)
    assert bad.cpu_milli is None and bad.name == ""
