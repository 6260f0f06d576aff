"""Fixture `dp`: one GPU node of the real control plane for a device-plugin test (see dp_node.DP)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import realk8s
from dp_node import DP


@pytest.fixture
def dp(cluster: realk8s.ControlPlane, tmp_path: Path) -> Iterator[DP]:
    d = DP(cluster, tmp_path)
    try:
        yield d
    finally:
        d.close()
