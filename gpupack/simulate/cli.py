"""`gpupack simulate`: compare placements offline.

    gpupack simulate [--out DIR] [--json]
        The embedded inference-fleet scenario (gpupack.simulate.fleet): whole-card allocation
        against gpupack's placement. Prints a table, writes DIR/fleet.png.

    gpupack simulate --trace PODS.csv --nodes NODES.csv [--policy NAME ...] [--seeds 42-51]
                     [--jobs N] [--out DIR] [--json] [--bound]
        Replays an openb trace as docs/simulate.md ("Replay rules") describes, one run per policy
        and seed. Prints mean unallocated GPUs at 100% arrival per policy; DIR/replay.png charts
        unallocated GPUs against arrived load. --json prints one object (see docs/simulate.md).
        --bound adds, per seed, a lower bound on that figure for any placement of the same
        arrivals (gpupack.simulate.bound) and each policy's gap to it.

    gpupack simulate --tidal [--trace PODS.csv --nodes NODES.csv] [--swing 4] [--json]
        A day of replicas following demand on an autoscaled pool, night consolidation (gpupack
        defrag --objective nodes) against none and an emptiest-node-first baseline
        (gpupack.simulate.tidal, docs/defrag.md). Writes DIR/tidal.png.

    gpupack simulate --tidal --preemption [--trace PODS.csv --nodes NODES.csv] [--checkpoint-min N] [--json]
        A day where offline jobs fill the night and online demand returns in the morning, on a
        fixed pool, with and without GPU-aware preemption (gpupack.simulate.preemption,
        docs/defrag.md): online time to placement, offline work lost. Writes DIR/preemption.png.

    gpupack simulate workload --trace PODS.csv -o FILE [--coverage 0.95]
        Writes the trace's workload (pod shapes and counts, as the replay gives it to the
        policies) as JSON, for `gpupack extender --workload-file FILE`.

Bad input (a malformed CSV row, an unknown policy) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpupack.core.policies import DEFAULT_POLICY, POLICIES, UnknownPolicy, policy_spec

DEFAULT_POLICIES = ("random", "bestfit", "fgd", DEFAULT_POLICY)


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, status 2
        raise UsageError(message)


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                a, b = part.split("-", 1) if not part.startswith("-") else (part, "")
                lo, hi = int(a), int(b)
                if hi < lo or hi - lo > 10_000:
                    raise ValueError
                seeds.extend(range(lo, hi + 1))
            else:
                seeds.append(int(part))
        except ValueError:
            raise UsageError(f"--seeds: {text!r} is not a seed list like 42-51 or 42,43") from None
    return seeds


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="gpupack simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--trace", help="openb pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...])"
    )
    p.add_argument("--nodes", help="openb node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument(
        "--churn",
        action="store_true",
        help="replay with departures and periodic defrag instead (options: gpupack simulate --churn --help)",
    )
    p.add_argument(
        "--tidal",
        action="store_true",
        help="a tidal day with and without night consolidation (options: gpupack simulate --tidal --help)",
    )
    p.add_argument(
        "--policy",
        action="append",
        help=f"policy to replay (repeatable); default: {' '.join(DEFAULT_POLICIES)}",
    )
    p.add_argument("--seeds", default="42-51", help="seeds, e.g. 42-51 or 42,43 (default 42-51)")
    p.add_argument("--jobs", type=int, default=0, help="parallel replays (default: number of CPUs)")
    p.add_argument(
        "--out", default="simulate-out", help="directory for the PNG chart (default ./simulate-out)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--bound",
        action="store_true",
        help="also a lower bound on unallocated GPUs at 100%% for any placement, per seed (LP, HiGHS)",
    )
    p.add_argument("--no-chart", action="store_true", help="skip the PNG")
    p.add_argument(
        "--progress", choices=("auto", "always", "never"), default="auto", help="stderr progress bar"
    )
    return p


# Worker state, inherited through fork so the trace is parsed once.
_W: dict = {}


def _init_worker(counter) -> None:
    _W["counter"] = counter


def _run_one(task: tuple[str, int]) -> dict:
    from gpupack.simulate.replay import replay

    policy, seed = task
    counter = _W.get("counter")
    last = [0]

    def tick(step: int) -> None:
        if counter is not None:
            with counter.get_lock():
                counter.value += step - last[0]
            last[0] = step

    t0 = time.perf_counter()
    r = replay(_W["nodes"], _W["pods"], policy, seed, workload=_W["workload"], progress=tick)
    tick(r.arrived)
    return {
        "policy": policy,
        "seed": seed,
        "unallocated_pct_at_100": r.unallocated_pct_at_100,
        "curve": [None if v is None else round(100.0 - v, 4) for v in r.curve],
        "arrived": r.arrived,
        "placed": r.placed,
        "seconds": time.perf_counter() - t0,
    }


BOUND_SAMPLES = 4  # events of bin 100 where the bound's program is solved (first and last among them)


def _bound_one(seed: int) -> dict:
    from gpupack.simulate.bound import bin_bound
    from gpupack.simulate.replay import arrival_order

    nodes, pods = _W["nodes"], _W["pods"]
    t0 = time.perf_counter()
    order = arrival_order(pods, nodes.gpu_capacity, seed)
    b = bin_bound(nodes, pods, order, samples=BOUND_SAMPLES)
    return {
        "bound": seed,
        "unallocated_pct_at_100": b.unallocated_pct,
        "events": b.events,
        "solved_at": b.solved_at,
        "seconds": time.perf_counter() - t0,
    }


def _run_task(task: tuple[str, int]) -> dict:
    return _bound_one(task[1]) if task[0] == _BOUND else _run_one(task)


_BOUND = "\0bound"  # a task name no policy can have


def run_trace(args) -> int:
    from gpupack.simulate.openb import read_nodes, read_pods
    from gpupack.simulate.replay import arrival_order, trace_workload

    if not args.nodes or not args.trace:
        raise UsageError("--trace and --nodes go together: give both CSV files")
    policies = args.policy or list(DEFAULT_POLICIES)
    for name in policies:
        try:
            spec = policy_spec(name)
        except UnknownPolicy as e:
            raise UsageError(f"--policy: {e}") from None
        if spec.fast_scorer is None:
            # the trace replay would otherwise have to stand another policy in for it
            raise UsageError(
                f"--policy: {name!r} cannot be replayed faithfully: its registry entry names no "
                'vectorised scorer (PolicySpec.fast_scorer); see docs/architecture.md, "Adding a policy"'
            )
    seeds = parse_seeds(args.seeds)
    nodes = read_nodes(args.nodes)
    pods = read_pods(args.trace)
    _W.update(nodes=nodes, pods=pods, workload=trace_workload(pods))
    tasks = [(p, s) for p in policies for s in seeds]
    if args.bound:
        try:
            import scipy  # noqa: F401  (HiGHS, in the `simulate` extra)
        except ImportError:
            raise UsageError(
                "--bound needs scipy, in gpupack's `simulate` extra: pip install 'gpupack[simulate]'"
            ) from None
        tasks = [(_BOUND, s) for s in seeds] + tasks  # the bound's solves are the longest tasks
    steps = sum(len(arrival_order(pods, nodes.gpu_capacity, s)) for s in seeds) * len(policies)
    jobs = args.jobs or min(os.cpu_count() or 1, len(tasks))
    enabled = {"auto": None, "always": True, "never": False}[args.progress]
    from gpupack.simulate.progress import Progress

    bar = Progress(steps, f"replaying {len(tasks)} run(s)", enabled=enabled)
    t0 = time.perf_counter()
    results: list[dict] = []
    if jobs <= 1:
        from multiprocessing import Value

        counter = Value("q", 0)
        _init_worker(counter)
        for t in tasks:
            results.append(_run_task(t))
            bar.update(counter.value)
    else:
        ctx = mp.get_context("fork")
        counter = ctx.Value("q", 0)
        with ctx.Pool(jobs, initializer=_init_worker, initargs=(counter,)) as pool:
            pending = pool.map_async(_run_task, tasks, chunksize=1)
            while not pending.ready():
                pending.wait(0.25)
                bar.update(counter.value)
            results = pending.get()
    bar.close()
    wall = time.perf_counter() - t0
    out = _summarise(args, policies, seeds, results, wall, steps)
    if not args.no_chart:
        from gpupack.simulate.chart import replay_chart

        mean_curves = {p: out["policies"][p]["mean_curve"] for p in policies}
        title = f"{Path(args.trace).name} on {Path(args.nodes).name}: mean of seeds {args.seeds}"
        bound = out["bound"]["unallocated_pct_at_100"] if "bound" in out else None
        png = _chart(lambda: replay_chart(mean_curves, Path(args.out) / "replay.png", title, bound=bound))
        if png is not None:
            out["chart"] = str(png)
    if args.json:
        print(json.dumps(out))
    else:
        _print_table(out)
    return 0


def _summarise(args, policies, seeds, results, wall, steps) -> dict:
    out: dict = {
        "trace": str(args.trace),
        "nodes": str(args.nodes),
        "seeds": seeds,
        "wall_seconds": round(wall, 2),
        "arrivals_per_second": round(steps / wall, 1) if wall > 0 else None,
        "policies": {},
    }
    bounds = {r["bound"]: r for r in results if "bound" in r}
    results = [r for r in results if "bound" not in r]
    for p in policies:
        rs = [r for r in results if r["policy"] == p]
        vals = [r["unallocated_pct_at_100"] for r in rs]
        finite = [v for v in vals if not math.isnan(v)]
        mean = sum(finite) / len(finite) if finite else None
        bins = len(rs[0]["curve"])
        mean_curve = []
        for b in range(bins):
            col = [r["curve"][b] for r in rs if r["curve"][b] is not None]
            mean_curve.append(sum(col) / len(col) if col else None)
        out["policies"][p] = {
            "unallocated_pct_at_100": None if mean is None else round(mean, 4),
            "per_seed": {str(r["seed"]): _num(r["unallocated_pct_at_100"]) for r in rs},
            "curves": {str(r["seed"]): r["curve"] for r in rs},
            "mean_curve": [None if v is None else round(v, 4) for v in mean_curve],
            "placed": {str(r["seed"]): r["placed"] for r in rs},
            "arrived": {str(r["seed"]): r["arrived"] for r in rs},
        }
    if bounds:
        _add_bound(out, seeds, bounds)
    return out


BOUND_RELAXES = (
    "a linear program over node types (HiGHS): exact GPU models, per-node fit, per-GPU packing "
    "of shares (arc-flow), per-node packing of multi-GPU pods, CPU and RAM per node type; relaxed: "
    "integrality, node boundaries for CPU and RAM (pooled per node type), arrival order (any pod "
    "may be left out)"
)


def _add_bound(out: dict, seeds: list[int], bounds: dict[int, dict]) -> None:
    """The bound per seed (the mean over bin 100's events, as the policies' figures; `solved_at`: the
    arrivals where the program was solved, `events`: how many the mean is over) and each policy's
    gap to it (policy - bound, points of capacity)."""
    per_seed = {str(s): _opt(bounds[s]["unallocated_pct_at_100"]) for s in seeds}
    out["bound"] = {
        "unallocated_pct_at_100": _mean(per_seed.values()),
        "per_seed": per_seed,
        "solved_at": {str(s): bounds[s]["solved_at"] for s in seeds},
        "events": {str(s): bounds[s]["events"] for s in seeds},
        "relaxes": BOUND_RELAXES,
    }
    for d in out["policies"].values():
        gaps = {
            s: None if v is None or per_seed.get(s) is None else round(v - per_seed[s], 4)
            for s, v in d["per_seed"].items()
        }
        d["gap_to_bound"] = {"mean": _mean(gaps.values()), "per_seed": gaps}


def _opt(v: float | None) -> float | None:
    return None if v is None else _num(v)


def _mean(vals) -> float | None:
    finite = [v for v in vals if v is not None]
    return round(sum(finite) / len(finite), 4) if finite else None


def _num(v: float) -> float | None:
    return None if math.isnan(v) else round(v, 4)  # JSON has no NaN


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}%"


def _print_table(out: dict) -> None:
    print(
        f"trace {out['trace']}  nodes {out['nodes']}  seeds {out['seeds'][0]}..{out['seeds'][-1]} ({len(out['seeds'])})"
    )
    bound = out.get("bound")
    gap_head = f" {'gap to bound':>13}" if bound else ""
    print(f"{'policy':<10} {'unallocated GPUs @100%':>24} {'min':>7} {'max':>7}{gap_head}")
    for p, d in out["policies"].items():
        vals = [v for v in d["per_seed"].values() if v is not None] or [float("nan")]
        mean = d["unallocated_pct_at_100"]
        gap = ""
        if bound:
            g = d["gap_to_bound"]["mean"]
            gap = f" {'n/a' if g is None else f'{g:+.2f}':>13}"
        print(f"{p:<10} {_pct(mean):>24} {min(vals):>6.2f}% {max(vals):>6.2f}%{gap}")
    if bound:
        vals = [v for v in bound["per_seed"].values() if v is not None] or [float("nan")]
        print(
            f"{'bound':<10} {_pct(bound['unallocated_pct_at_100']):>24} {min(vals):>6.2f}% {max(vals):>6.2f}%"
        )
        print("  (bound: lower bound for any placement of the same arrivals; gap = policy - bound, points)")
    print(
        f"{out['arrivals_per_second']} arrivals/s over {out['wall_seconds']} s"
        + (f"; chart {out['chart']}" if "chart" in out else "")
    )


def _chart(draw: Callable[[], Path]) -> Path | None:
    """The figures matter more than the picture: without the `simulate` extra (matplotlib) say so
    in one line and print the results anyway."""
    from gpupack.simulate.chart import ChartUnavailable

    try:
        return draw()
    except ChartUnavailable as e:
        print(f"gpupack simulate: no chart: {e}", file=sys.stderr)
        return None


def run_fleet(args) -> int:
    from gpupack.simulate.fleet import run_fleet_scenario

    result = run_fleet_scenario()
    if not args.no_chart:
        from gpupack.simulate.chart import fleet_chart

        png = _chart(lambda: fleet_chart(result["modes"], Path(args.out) / "fleet.png", result["title"]))
        if png is not None:
            result["chart"] = str(png)
    if args.json:
        print(json.dumps(result))
    else:
        from gpupack.simulate.fleet import format_table

        print(format_table(result))
    return 0


def run_workload(argv: list[str]) -> int:
    """`gpupack simulate workload`: the trace's workload as the extender's --workload-file."""
    from gpupack.core.fgd import workload_to_json
    from gpupack.simulate.openb import read_pods
    from gpupack.simulate.replay import trace_workload

    p = _Parser(prog="gpupack simulate workload", description=run_workload.__doc__)
    p.add_argument("--trace", required=True, help="openb pod list CSV")
    p.add_argument("-o", "--out", required=True, help="JSON file to write ('-': stdout)")
    p.add_argument(
        "--coverage", type=float, default=0.95, help="share of pods the typical shapes cover (0.95)"
    )
    args = p.parse_args(argv)
    if not 0 < args.coverage <= 1:
        raise UsageError("--coverage: must be in (0, 1]")
    text = json.dumps(workload_to_json(trace_workload(read_pods(args.trace), args.coverage)), indent=1) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        import numpy  # noqa: F401  (the replays' arrays; in the `simulate` extra, not in the image)
    except ImportError:
        print("gpupack simulate needs numpy, in gpupack's `simulate` extra: pip install 'gpupack[simulate]'",
              file=sys.stderr)  # fmt: skip
        return 2
    from gpupack.simulate.openb import TraceError

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["workload"]:
        try:
            return run_workload(argv[1:])
        except (UsageError, TraceError, OSError) as e:
            print(f"gpupack simulate workload: {e}", file=sys.stderr)
            return 2
    if "--churn" in argv:
        # Departures + periodic defrag is its own experiment with its own options.
        from gpupack.simulate import churn

        return churn.main(argv)
    if "--preemption" in argv:
        # Offline jobs fill the night, online demand returns: with and without preemption.
        from gpupack.simulate import preemption

        return preemption.main(argv)
    if "--tidal" in argv:
        # A day of replicas following demand, an autoscaled pool, night consolidation on and off.
        from gpupack.simulate import tidal

        return tidal.main(argv)
    try:
        args = _parser().parse_args(argv)
        if args.jobs < 0:
            raise UsageError("--jobs: must be 0 (auto) or more")
        if args.trace or args.nodes:
            return run_trace(args)
        return run_fleet(args)
    except (UsageError, TraceError) as e:
        print(f"gpupack simulate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpupack simulate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["main", "POLICIES"]
