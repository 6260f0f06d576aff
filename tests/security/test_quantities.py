"""Quantities are length- and exponent-checked before any conversion: int() of a Decimal such as
1e300000 is quadratic in its digits and held the GIL for ~6 s per request (issue 11)."""

from __future__ import annotations

import time

import pytest

from gpupack.contract import ContractError, parse_int_quantity, parse_quantity
from gpupack.core.request import RequestError, parse_pod


@pytest.mark.parametrize(
    "value,why",
    ids=[
        "1e300000",
        "-1e-300000",
        "1e31",
        "5000 nines",
        "71 digits",
        "int 10**4000",
        "1e300 float",
        "nan",
        "Infinity",
    ],
    argvalues=[
        ("1e300000", "out of range"),
        ("-1e-300000", "out of range"),
        ("1e31", "out of range"),
        ("9" * 5000, "longer than 64 characters"),
        ("1" + "0" * 70, "longer than 64 characters"),
        (10**4000, "out of range"),
        (1e300, "out of range"),
        (float("nan"), "out of range"),
        ("Infinity", "not a Kubernetes quantity"),
    ],
)
def test_refused_at_once_with_the_reason(value: object, why: str) -> None:
    # this thread's CPU time, not the clock: on a loaded machine the clock counts other processes'
    # turns (a 10 ms wall-clock bound failed at load 10 on 2 cores); the conversion it guards
    # against costs seconds of CPU
    t0 = time.thread_time()
    with pytest.raises(ContractError, match=why):
        parse_int_quantity(value, "container 'a' gpupack.io/gpu-mem")
    assert time.thread_time() - t0 < 0.05


def test_real_quantities_still_parse():
    assert parse_int_quantity("20k", "x") == 20000
    assert parse_int_quantity("1e3", "x") == 1000
    assert parse_int_quantity("16Gi", "x") == 16 * 2**30
    assert parse_quantity("1500m") * 1000 == 1500
    assert parse_int_quantity("1E", "x") == 10**18


def test_the_pod_parser_names_the_container():
    pod = {"metadata": {"name": "p", "namespace": "n"}, "spec": {"containers": [
        {"name": "a", "resources": {"limits": {"gpupack.io/gpu-mem": "1e300000"}}}]}}  # fmt: skip
    with pytest.raises(
        RequestError, match=r"pod n/p container 'a' gpupack.io/gpu-mem: '1e300000' is out of range"
    ):
        parse_pod(pod)
