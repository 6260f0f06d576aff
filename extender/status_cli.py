"""`gpupack status` (also `kubectl gpupack status`): per node and GPU, what gpupack has reserved.

Rebuilt from the cluster (node inventories and pod assignments) with the same code the extender
uses, so it shows what any extender would rebuild, independent of a running one.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpupack import logs
from gpupack.core.model import FULL

from .state.view import ClusterView


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupack status", description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--node", action="append", help="only this node (repeatable)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="also list nodes without a gpupack inventory")
    logs.add_log_flags(p)
    return p


def collect(view: ClusterView, only: set[str] | None = None, include_empty: bool = False) -> dict[str, Any]:
    nodes = []
    with view.lock:
        for name in sorted(view.nodes):
            if only and name not in only:
                continue
            info = view.nodes[name]
            node = view.state.nodes.get(name)
            if node is None or (not node.gpus and not info.inventory_error and not include_empty):
                continue
            gpus = []
            for pos, g in enumerate(node.gpus):
                gpus.append(
                    {
                        "index": info.gpu_indexes[pos] if pos < len(info.gpu_indexes) else g.index,
                        "uuid": g.uuid,
                        "model": g.model,
                        "healthy": g.healthy,
                        "class": g.pod_class,
                        "exclusive": g.exclusive,
                        "mem_reserved_mib": g.mem_used,
                        "mem_total_mib": g.mem_mib,
                        "sm_reserved_pct": round(g.milli_used * 100 / FULL, 1),
                        "pods": [
                            {"pod": k, "mem_mib": m, "sm_pct": round(k2 * 100 / FULL, 1)}
                            for k, (m, k2) in sorted(g.holders.items())
                        ],
                    }
                )
            pending = sorted(k for k in view.locks.pending.get(name, ()) if k in view.pods)
            nodes.append(
                {
                    "node": name,
                    "schedulable": node.schedulable,
                    "inventory_error": info.inventory_error or None,
                    "inventory_conflict": info.inventory_conflict or None,
                    "reservations_error": info.reservations_error or None,
                    "defrag_reservations": [r.id for r in info.reservations],
                    "pending_handoffs": pending,
                    "gpus": gpus,
                }
            )
        problems = dict(view.problems)
    return {"nodes": nodes, "problems": problems}


def render(data: dict[str, Any]) -> str:
    rows = [("NODE", "GPU", "MODEL", "CLASS", "MEMORY MiB", "SM", "PODS")]
    notes = []
    for n in data["nodes"]:
        if n["inventory_error"]:
            notes.append(f"{n['node']}: inventory unreadable: {n['inventory_error']}")
        if not n["gpus"]:
            rows.append((n["node"], "-", "-", "-", "-", "-", "no gpupack inventory"))
        for g in n["gpus"]:
            cls = (g["class"] or "-") + (" (whole)" if g["exclusive"] else "")
            if not g["healthy"]:
                cls += " UNHEALTHY"
            pods = ", ".join(f"{p['pod']} ({p['mem_mib']} MiB, {p['sm_pct']:g}%)" for p in g["pods"]) or "-"
            rows.append(
                (
                    n["node"],
                    str(g["index"]),
                    g["model"],
                    cls,
                    f"{g['mem_reserved_mib']}/{g['mem_total_mib']}",
                    f"{g['sm_reserved_pct']:g}%",
                    pods,
                )
            )
        if n["pending_handoffs"]:
            notes.append(f"{n['node']}: GPU handoff pending for {', '.join(n['pending_handoffs'])}")
        if n["defrag_reservations"]:
            notes.append(f"{n['node']}: defrag reservations {', '.join(n['defrag_reservations'])}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    lines += notes + [f"problem: {m}" for m in data["problems"].values()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args, starting=False)
    try:
        from kubernetes.client.rest import ApiException
        from kubernetes.config import ConfigException
        from urllib3.exceptions import HTTPError

        from .api.kube import Kube, api_client

        kube = Kube(api_client(args.kubeconfig))
        view = ClusterView()
        view.replace_nodes(kube.list_nodes().get("items") or [])
        view.replace_pods(kube.list_pods().get("items") or [])
    except ApiException as e:
        print(f"gpupack status: the API server answered {e.status} {e.reason}", file=sys.stderr)
        return 1
    except (ConfigException, HTTPError, OSError) as e:
        print(f"gpupack status: cannot reach the cluster: {e}", file=sys.stderr)
        return 1
    data = collect(view, set(args.node) if args.node else None, args.all)
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
