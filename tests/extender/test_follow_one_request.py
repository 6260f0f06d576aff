"""Follow one pod through the extender: the product modules one `/filter` request and one `/bind`
enter, in order, recorded with sys.setprofile on the thread that answers them (the extender's
WSGI path, in this process, over the real API server). A request that flows calls each module
once and never comes back to one it has left; one that bounces re-enters the same modules again
and again. The sequences are printed (pytest -s) for docs/architecture.md's diagrams."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
from ext_helpers import container, create_pod, gpu_node, pod_obj

from extender.api.kube import Kube, api_client
from extender.main import build_parser, extender_config, make_policy
from extender.serve.app import create_extender_app
from extender.state.metrics import Metrics
from extender.state.sync import Sync
from extender.state.view import ClusterView
from extender.verbs.framework import Extender

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("extender",)  # the modules followed; gpupack.core and the contract are its library


def module_of(filename: str) -> str | None:
    """The product module a code object belongs to (None: the library, tests, the stdlib)."""
    path = Path(filename)
    if not path.is_relative_to(ROOT) or path.suffix != ".py":
        return None
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts) if rel.parts[0] in PRODUCT else None


class Entries:
    """Each call into a product module from code of another module: (from, into, function)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, str, str]] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        into = module_of(frame.f_code.co_filename)
        if into is None:
            return
        back = frame.f_back
        src = module_of(back.f_code.co_filename) if back is not None else None
        if src != into:
            self.calls.append((src, into, frame.f_code.co_name))

    def modules(self) -> list[str]:
        """The modules entered, in the order first entered."""
        return list(dict.fromkeys(into for _, into, _ in self.calls))

    def returns(self) -> list[tuple[str | None, str, str]]:
        """The entries into a module entered before: the pod came back to a module it had left."""
        seen: set[str] = set()
        out = []
        for c in self.calls:
            if c[1] in seen:
                out.append(c)
            seen.add(c[1])
        return out


def traced(fn: Callable[[], Any]) -> tuple[Any, Entries]:
    entries = Entries()
    sys.setprofile(entries)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, entries


def show(verb: str, e: Entries) -> None:
    print(f"\n{verb}: {len(e.modules())} modules, {len(e.calls)} entries, {len(e.returns())} returns")
    print("  " + " > ".join(m.removeprefix("extender.") for m in e.modules()))
    for src, into, fn in e.returns():
        print(f"  back into {into}.{fn} from {src}")


@pytest.fixture
def wired(cluster, ns, sfx, tmp_path):
    """The extender as `gpupack extender` wires it with its shipped flags, its view synced from the
    real API server, and three nodes."""
    nodes = [f"follow-{i}-{sfx}" for i in range(3)]
    for n in nodes:
        gpu_node(cluster, n, 2)
    args = build_parser().parse_args(["--webhook-port", "0"])
    view = ClusterView(track_host=True)
    kube = Kube(api_client(str(cluster.write_kubeconfig(tmp_path / "kc"))), timeout_s=10)
    ext = Extender(view, make_policy(args), kube, extender_config(args), metrics=Metrics())
    sync = Sync(view, kube)
    sync.start()
    assert view.synced.wait(30)
    app = create_extender_app(ext)

    def post(path: str, body: dict[str, Any]) -> Any:
        raw = json.dumps(body).encode()
        env: dict[str, Any] = {}
        setup_testing_defaults(env)
        env.update(REQUEST_METHOD="POST", PATH_INFO=path, CONTENT_LENGTH=str(len(raw)))
        env["CONTENT_TYPE"], env["wsgi.input"] = "application/json", io.BytesIO(raw)
        return json.loads(b"".join(app(env, lambda status, headers, exc=None: None)))

    yield nodes, post
    sync.stop.set()


def test_one_filter_and_one_bind_enter_few_modules_and_never_come_back(wired, cluster, ns) -> None:
    nodes, post = wired
    for name in ("first", "p"):  # the first pod of its shape warms what every later one reuses
        pod = create_pod(cluster.core, pod_obj(name, [container("c", gpu=1, mem=10_000)], namespace=ns), ns)
        answer, f = traced(lambda pod=pod: post("/filter", {"Pod": pod, "NodeNames": nodes}))
        assert answer["NodeNames"], answer
        bind = {
            "PodName": name,
            "PodNamespace": ns,
            "PodUID": pod["metadata"]["uid"],
            "Node": answer["NodeNames"][0],
        }
        done, b = traced(lambda bind=bind: post("/bind", bind))
        assert done == {"Error": ""}, done
    show("filter", f)
    show("bind", b)
    # the verb's own module is entered once: nothing it calls calls back into it
    assert [c for c in f.calls if c[1] == "extender.verbs.filtering"] == [
        ("extender.verbs.framework", "extender.verbs.filtering", "filter")
    ]
    assert [c for c in b.calls if c[1] == "extender.verbs.binding"] == [
        ("extender.verbs.framework", "extender.verbs.binding", "bind")
    ]
    # the filter's stages, each entered once, in the pipeline's order
    stages = [fn for _, into, fn in f.calls if into == "extender.verbs.filter_stages"]
    assert stages == ["steer", "rank", "settle"], stages
    # No more modules and returns than today: the filter's returns left are the view's parts a fit
    # reads (journal, view, node resources), the stages and the bind locks each entered in turn;
    # the bind's, the view's parts a bind updates one by one.
    assert len(f.modules()) <= FILTER_MODULES and len(f.returns()) <= FILTER_RETURNS
    assert len(b.modules()) <= BIND_MODULES and len(b.returns()) <= BIND_RETURNS


# measured with the placement index holding the fits and the filter answers (one filter: 18
# modules and 12 returns, from 19 and 21 with the caches in three modules; one bind: 18 and 19)
FILTER_MODULES, FILTER_RETURNS = 18, 12
BIND_MODULES, BIND_RETURNS = 18, 19
