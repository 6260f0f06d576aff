"""Tidal-day benchmark: node-hours saved by night consolidation (`gpupack defrag --objective nodes`)
on the embedded day and on a day built from the openb trace, with no consolidation and the
emptiest-node-first baseline in the same run (gpupack.simulate.tidal; docs/defrag.md).

Usage: python benchmarks/bench_tidal.py [--openb DIR] [--swing 4] [--seeds 1,2,3] [--json]

DIR defaults to $GPUPACK_SHARED/data/openb or ../shared/data/openb next to the repository; without
the trace only the embedded day runs (and the output says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpupack.simulate.tidal import Settings, embedded_day, format_table, openb_day, simulate  # noqa: E402


def default_openb() -> Path | None:
    env = os.environ.get("GPUPACK_SHARED")
    d = (Path(env) if env else Path(__file__).resolve().parents[2] / "shared") / "data" / "openb"
    return d if (d / "openb_node_list_gpu_node.csv").is_file() else None


def summary(runs: list[dict]) -> dict:
    """Per (mode, pre-scale): mean over seeds of the figures that matter."""
    rows: dict[str, dict] = {}
    for out in runs:
        for r in out["results"]:
            key = f"{r['mode']}{'' if r['prescale'] else ' (no pre-scale)'}"
            rows.setdefault(key, []).append(r)  # type: ignore[arg-type]
    out = {}
    for key, rs in rows.items():  # type: ignore[assignment]
        out[key] = {
            f: round(statistics.fmean(r[f] for r in rs), 3)
            for f in (
                "node_hours",
                "node_hours_saved",
                "node_hours_saved_pct",
                "gpu_hours",
                "evictions",
                "nodes_emptied",
                "morning_pending_max",
                "morning_pending_pod_hours",
                "plan_seconds",
            )
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--openb", type=Path, default=default_openb())
    p.add_argument("--pods", default="openb_pod_list_default.csv")
    p.add_argument("--sample-nodes", type=int, default=40)
    p.add_argument("--swing", type=float, default=4.0)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    base = Settings(swing=args.swing)
    doc: dict = {"swing": args.swing, "seeds": seeds, "days": {}}
    t0 = time.perf_counter()
    emb = [simulate(embedded_day(args.swing), replace(base, seed=s)) for s in seeds]
    doc["days"]["embedded"] = {"title": emb[0]["day"], "mean": summary(emb)}
    texts = [format_table(emb[0])]
    if args.openb is not None:
        runs = []
        for s in seeds:
            day = openb_day(
                args.openb / args.pods,
                args.openb / "openb_node_list_gpu_node.csv",
                nodes=args.sample_nodes,
                swing=args.swing,
                seed=s,
            )
            runs.append(simulate(day, replace(base, seed=s)))
        doc["days"]["openb"] = {"title": runs[0]["day"], "mean": summary(runs)}
        texts.append(format_table(runs[0]))
    else:
        doc["days"]["openb"] = None
        texts.append("openb trace not found: pass --openb DIR (or set GPUPACK_SHARED)")
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print("\n\n".join(texts))
    for name, d in doc["days"].items():
        if d is None:
            continue
        print(f"\n{name}: mean over seeds {args.seeds}")
        print(f"{'':28}{'node-h':>9}{'saved %':>9}{'GPU-h':>9}{'evictions':>11}{'morning pending':>17}")
        for key, r in d["mean"].items():
            print(
                f"{key:28}{r['node_hours']:>9.1f}{r['node_hours_saved_pct']:>9.1f}{r['gpu_hours']:>9.1f}"
                f"{r['evictions']:>11.1f}{r['morning_pending_max']:>17.1f}"
            )
    print(f"\n{doc['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
