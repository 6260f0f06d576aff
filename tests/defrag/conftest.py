from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from defrag_cluster import Fleet
from faultproxy import FaultProxy
from realk8s import ControlPlane


@pytest.fixture
def fleet(cluster: ControlPlane) -> Fleet:
    return Fleet(cluster)


@pytest.fixture
def proxy(cluster: ControlPlane) -> Iterator[FaultProxy]:
    """What defrag sends to the API server passes here: recorded, and faults on demand."""
    with FaultProxy(cluster.url) as p:
        yield p


@pytest.fixture
def kubeconfig(cluster: ControlPlane, proxy: FaultProxy, tmp_path: Path) -> Path:
    """An admin kubeconfig for `gpupack defrag`, through the proxy."""
    return cluster.write_kubeconfig(tmp_path / "kubeconfig", server=proxy.url)
