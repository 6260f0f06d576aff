"""deploy/examples' tidal-day objects: the real API server accepts them, and the night CronJob's
arguments are ones `gpupack defrag` understands."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from extender.controllers.defrag.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deploy" / "examples"
# the release the manifests pin (tests/test_version.py holds every kustomization to it)
RELEASE = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def pinned_image(kustomization: Path) -> str:
    """`name:tag` the kustomization makes of the `gpupack` image."""
    (img,) = [
        i for i in yaml.safe_load(kustomization.read_text()).get("images", []) if i["name"] == "gpupack"
    ]
    return f"{img.get('newName', 'gpupack')}:{img['newTag']}"


def rendered(cluster, where: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(cluster.kubectl("kustomize", str(where))) if d]


def test_night_consolidation_cronjob_runs_gpupack_defrag_with_valid_flags(cluster):
    docs = rendered(cluster, EXAMPLES / "night-consolidation")
    jobs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CronJob"}
    night = jobs["gpupack-night-consolidation"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = night["containers"]
    image = pinned_image(EXAMPLES / "night-consolidation" / "kustomization.yaml")
    assert image.endswith(f":{RELEASE}")
    assert c["command"] == ["gpupack", "defrag"] and c["image"] == image
    args = build_parser().parse_args(c["args"])
    assert args.apply and args.objective == "nodes" and args.window == "01:00-05:00"
    # It shares the run Lease with the GPU defrag CronJob, and runs as its ServiceAccount.
    defrag = jobs["gpupack-defrag"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert args.lease_name == build_parser().parse_args(defrag["containers"][0]["args"]).lease_name
    assert night["serviceAccountName"] == defrag["serviceAccountName"] == "gpupack-defrag"


def test_the_api_server_accepts_the_tidal_examples(cluster):
    """Server-side dry run of every object, moved to a test namespace (the real namespaces are
    other tests' to create)."""
    ns = f"tidal-ex-{id(cluster) % 10000}"
    cluster.ensure_namespace(ns)
    docs = rendered(cluster, EXAMPLES / "night-consolidation") + [
        d for d in rendered(cluster, EXAMPLES) if d["kind"] != "Namespace"
    ]
    moved = []
    for d in docs:
        if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            continue
        d["metadata"]["namespace"] = ns
        for s in d.get("subjects") or []:
            s["namespace"] = ns
        moved.append(d)
    out = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(moved)
    )
    assert out.count("serverside-applied (server dry run)") == len(moved), out
    kinds = {d["kind"] for d in moved}
    assert {"CronJob", "Role", "RoleBinding", "ServiceAccount", "HorizontalPodAutoscaler"} <= kinds
