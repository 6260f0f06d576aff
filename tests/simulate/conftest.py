import os
from pathlib import Path

import numpy as np
import pytest

from gpupack.simulate.openb import NodeList, read_nodes, read_pods


def openb_dir() -> Path:
    base = os.environ.get("GPUPACK_SHARED")
    root = Path(base) if base else Path(__file__).resolve().parents[2] / ".." / "shared"
    return root / "data" / "openb"


@pytest.fixture(scope="session")
def openb() -> Path:
    d = openb_dir()
    if not (d / "openb_node_list_gpu_node.csv").is_file():
        pytest.skip(f"openb trace not found at {d} (set GPUPACK_SHARED to the shared/ folder)")
    return d


@pytest.fixture(scope="session")
def small_cluster(openb):
    """A deterministic reduced replay: every 24th node (~51) and every 20th pod of the default trace."""
    nodes = read_nodes(openb / "openb_node_list_gpu_node.csv")
    idx = np.arange(0, len(nodes), 24)
    sub = NodeList(
        [nodes.names[i] for i in idx],
        nodes.cpu[idx],
        nodes.ram[idx],
        nodes.gpus[idx],
        [nodes.model[i] for i in idx],
    )
    return sub


def reduced_pods(openb, trace: str, step: int = 20):
    pods = read_pods(openb / f"openb_pod_list_{trace}.csv")
    return pods.take(np.arange(0, len(pods), step))
