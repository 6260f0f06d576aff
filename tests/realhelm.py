"""Real Helm clients for tests: Helm v4 (``helm``) and Helm v3 (``helm3``) from ``../shared/helm``.

The folder holds ``bin/<name>.xz`` and ``SHA256SUMS`` of the unpacked binaries (as ``../shared/k8s``
does for Kubernetes). It is ``$GPUPACK_HELM_ASSETS``, else ``$GPUPACK_SHARED/helm``, else
``../shared/helm`` beside the repository. Each binary is unpacked once into
``$GPUPACK_HELM_CACHE`` (default ``~/.cache/gpupack/helm/<checksum>``) and checked against
``SHA256SUMS`` before it is used.

Nothing here is product code: it lives in ``tests/`` and is never installed.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import realk8s

REPO = Path(__file__).resolve().parents[1]
# the two clients users run today: Helm 4 and the last Helm 3 line
CLIENTS = ("helm", "helm3")
HOW_TO_GET = (
    "real Helm binaries not found: set GPUPACK_HELM_ASSETS to a folder with bin/helm.xz, "
    "bin/helm3.xz and SHA256SUMS (as ../shared/helm has), or check out ../shared beside the repository"
)


def assets_dir() -> Path | None:
    """The folder holding ``bin/*.xz`` and ``SHA256SUMS``, or None when it cannot be found."""
    if os.environ.get("GPUPACK_HELM_ASSETS"):
        candidates = [Path(os.environ["GPUPACK_HELM_ASSETS"])]  # asked for by name: that one or none
    else:
        candidates = [Path(os.environ["GPUPACK_SHARED"]) / "helm"] if os.environ.get("GPUPACK_SHARED") else []
        candidates.append(REPO.parent / "shared" / "helm")
    return next((c for c in candidates if (c / "SHA256SUMS").is_file() and (c / "bin").is_dir()), None)


def required() -> bool:
    """CI's switch for real binaries (GPUPACK_REQUIRE_K8S, set by .ci/run): a missing Helm is then
    a failure, never a skip."""
    return os.environ.get("GPUPACK_REQUIRE_K8S", "") not in ("", "0")


def binary(name: str, assets: Path | None = None) -> Path:
    """Path of an unpacked, checksum-verified Helm client (``helm`` or ``helm3``)."""
    assets = assets or assets_dir()
    if assets is None:
        raise FileNotFoundError(HOW_TO_GET)
    cache = Path(os.environ.get("GPUPACK_HELM_CACHE") or Path.home() / ".cache" / "gpupack" / "helm")
    return realk8s.unpack(name, assets, cache)


def version(name: str) -> tuple[int, int, int]:
    """(major, minor, patch) that client reports (``helm version --short``: "v4.1.4+g...")."""
    out = subprocess.run(
        [str(binary(name)), "version", "--short"], capture_output=True, text=True, timeout=60
    )
    m = re.match(r"v(\d+)\.(\d+)\.(\d+)", out.stdout.strip())
    if m is None:
        raise RuntimeError(f"{name} version said {out.stdout + out.stderr!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def env(home: Path) -> dict[str, str]:
    """An environment in which Helm keeps its cache, config and data under `home` (never the user's
    own repositories or plugins) and never reaches the network for a chart."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    e.update(
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
    )
    return e
