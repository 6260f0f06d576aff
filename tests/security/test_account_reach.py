"""Issue 31 items 3-4: each gpupack account's reach, as the real API server tells its own token
(`kubectl auth can-i --list`, i.e. a SelfSubjectRulesReview), is exactly the table "What each
token may do" in docs/operator-guide.md. RBAC only: what the admission policies narrow further is
in the security-model table above it and tested in test_admission_state.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import deploy_objects
import pytest
from realk8s import ControlPlane, binary

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md"
FILES = ("scheduler/serviceaccount.yaml", "scheduler/rbac.yaml", "deviceplugin/serviceaccount.yaml",
         "deviceplugin/rbac.yaml", "defrag/serviceaccount.yaml", "defrag/rbac.yaml")  # fmt: skip
ACCOUNTS = ("gpupack-scheduler", "gpupack-extender", "gpupack-device-plugin", "gpupack-defrag")
# granted to every authenticated user by the API server's own defaults
EVERYONE = {"selfsubjectaccessreviews.authorization.k8s.io", "selfsubjectrulesreviews.authorization.k8s.io",
            "selfsubjectreviews.authentication.k8s.io"}  # fmt: skip

Row = tuple[str, str, str]  # resource, resource names, verbs (each as kubectl prints them, sorted)


def _norm(resource: str, names: str, verbs: str) -> Row:
    def items(cell: str) -> str:
        return " ".join(sorted(cell.strip().strip("[]").replace(",", " ").split()))

    return resource.strip().strip("`"), items(names.strip("`")), items(verbs.strip("`"))


def _documented(version: tuple[int, int]) -> dict[str, set[Row]]:
    """The table's rows for a server of `version`: the common table, and the rows of the
    "Only on v1.N" tables for this version (Kubernetes' own scheduler role differs between them)."""
    text = GUIDE.read_text()
    section = text.split("#### What each token may do", 1)[1].split("\n#", 1)[0]
    out: dict[str, set[Row]] = {a: set() for a in ACCOUNTS}
    only: tuple[int, int] | None = None
    for line in section.splitlines():
        m = re.match(r"Only on v(\d+)\.(\d+)\b", line)
        if m:
            only = (int(m.group(1)), int(m.group(2)))
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].strip("`") in out and only in (None, version):
            out[cells[0].strip("`")].add(_norm(*cells[1:]))
    return out


def _granted(cp: ControlPlane, ns: str, sa: str, tmp: Path) -> set[Row]:
    kc = cp.service_account_kubeconfig(tmp / f"{sa}.kubeconfig", ns, sa)
    out = subprocess.run([str(binary("kubectl", cp.assets)), "--kubeconfig", str(kc), "auth", "can-i", "--list",
                          "-n", ns], capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    rows = set()
    for line in out.splitlines()[1:]:
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) != 4 or cols[1] != "[]":  # non-resource URLs are the API server's defaults
            continue
        if cols[0] not in EVERYONE:
            rows.add(_norm(cols[0], cols[2], cols[3]))
    return rows


@pytest.mark.parametrize("sa", ACCOUNTS)
def test_each_tokens_reach_is_the_documented_one(k8s: ControlPlane, tmp_path: Path, sa: str) -> None:
    ns = f"reach-{deploy_objects.suffix()}"
    k8s.ensure_namespace(ns)
    deploy_objects.apply(k8s, deploy_objects.remap([o for f in FILES for o in deploy_objects.load(f)], ns))
    granted, documented = _granted(k8s, ns, sa, tmp_path), _documented(k8s.server_version())[sa]
    assert granted == documented, (
        f"{sa}: granted but not documented {sorted(granted - documented)}; "
        f"documented but not granted {sorted(documented - granted)}"
    )
