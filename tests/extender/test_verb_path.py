"""The verbs' one path (extender/serve/app.py `verb_path`): however the body arrives (with a
Content-Length, chunked, too large, missing), the answer, its status, its metrics and the verb
activity are the verb path's, and an unexpected error is a 500 answer, never an exception out of
the app. Through Flask's test client: no server, no control plane."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ext_helpers import container, node_obj, pod_obj

from extender.serve.app import create_extender_app
from extender.state.metrics import Metrics
from extender.state.view import ClusterView
from extender.verbs.framework import Extender
from gpupack.core.policies import DEFAULT_POLICY, get_policy

MAX_BODY = 64 * 1024


@pytest.fixture
def ext() -> Extender:
    view = ClusterView()
    view.replace_nodes([node_obj("n1"), node_obj("n2")])
    view.replace_pods([])
    view.synced.set()
    return Extender(view, get_policy(DEFAULT_POLICY), None, metrics=Metrics())


def _body() -> bytes:
    pod = pod_obj("p", [container("c", mem=1024)])
    pod["metadata"]["uid"] = "uid-p"
    return json.dumps({"Pod": pod, "NodeNames": ["n1", "n2"], "Nodes": None}).encode()


def _sample(ext: Extender, name: str, verb: str) -> float:
    return ext.metrics.registry.get_sample_value(name, {"verb": verb}) or 0.0


# what a server that delimits a chunked body may hand the app: no Content-Length, the input delimited
CHUNKED: dict[str, Any] = {"CONTENT_LENGTH": "", "wsgi.input_terminated": True}


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
def test_a_chunked_body_gets_the_answer_a_sized_one_gets(ext: Extender, verb: str) -> None:
    app = create_extender_app(ext, MAX_BODY).test_client()
    sized = app.post(f"/{verb}", data=_body(), content_type="application/json")
    chunked = app.post(f"/{verb}", data=_body(), content_type="application/json", environ_overrides=CHUNKED)
    assert sized.status_code == chunked.status_code == 200, (sized.data, chunked.data)
    assert sized.data == chunked.data
    assert sized.content_type == chunked.content_type == "application/json"
    assert chunked.headers["Server-Timing"].startswith(f"{verb};dur=")
    assert _sample(ext, "gpupack_extender_request_seconds_count", verb) == 2
    assert _sample(ext, "gpupack_extender_answer_seconds_count", verb) == 2


def test_a_body_over_the_limit_is_413_with_or_without_a_length(ext: Extender) -> None:
    app = create_extender_app(ext, MAX_BODY).test_client()
    big = b"[" + b"1," * MAX_BODY + b"1]"
    for overrides in ({}, CHUNKED):
        r = app.post("/filter", data=big, content_type="application/json", environ_overrides=overrides)
        assert r.status_code == 413, r.data
        assert r.get_json() == {"Error": f"request body larger than {MAX_BODY} bytes"}
    assert _sample(ext, "gpupack_extender_bad_requests_total", "filter") == 2
    assert ext.activity.quiet_for() > 0.0  # left quiet again


def test_no_length_and_no_delimited_input_is_an_empty_body(ext: Extender) -> None:
    # PEP 3333: without a Content-Length the input may be read only when the server delimits it
    app = create_extender_app(ext, MAX_BODY).test_client()
    r = app.post(
        "/filter", data=_body(), content_type="application/json", environ_overrides={"CONTENT_LENGTH": ""}
    )
    assert r.status_code == 400
    assert r.get_json() == {"Error": "empty request body; expected JSON"}


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_verb_path_takes_only_post(ext: Extender, method: str) -> None:
    app = create_extender_app(ext, MAX_BODY).test_client()
    r = app.open("/filter", method=method)
    assert r.status_code == 405
    assert r.headers["Allow"] == "POST"
    assert r.get_json() == {"Error": "The method is not allowed for the requested URL."}


def test_an_unexpected_error_is_a_500_answer_and_the_next_request_is_served(
    ext: Extender, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_extender_app(ext, MAX_BODY).test_client()
    good = app.post("/filter", data=_body(), content_type="application/json").data

    def broken(args: Any) -> Any:
        raise KeyError("boom")

    monkeypatch.setattr(ext, "filter", broken)
    r = app.post("/filter", data=_body(), content_type="application/json")
    assert r.status_code == 500
    assert r.get_json() == {"Error": "internal error: KeyError: 'boom'"}
    assert "unhandled error on /filter" in caplog.text
    assert ext.activity.quiet_for() > 0.0
    monkeypatch.undo()
    assert app.post("/filter", data=_body(), content_type="application/json").data == good


def test_the_other_paths_are_flask_s(ext: Extender) -> None:
    app = create_extender_app(ext, MAX_BODY).test_client()
    assert app.get("/healthz").data == b"ok\n"
    assert app.get("/readyz").status_code == 200
    assert b"gpupack_extender_request_seconds" in app.get("/metrics").data
    r = app.post("/nope", data=b"{}")
    assert r.status_code == 404 and "Error" in r.get_json()
