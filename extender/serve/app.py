"""The WSGI apps: the extender's verbs (`verb_path`, in front of Flask's health, readiness and
metrics) and the admission webhook (Flask).

Handlers are thin: decode JSON, call the framework or webhook core, encode JSON. Every error a
client causes is a 4xx with a one-line reason; anything else is logged and answered 500 without
taking the worker down.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import orjson
from flask import Flask, Response, request
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES

from gpupack.guarded import Probe

from ..api.wire import WireError, parse_bind_args, parse_extender_args
from ..state.gpu_gauges import render
from ..state.metrics import Metrics
from ..state.view import ClusterView
from ..verbs.collector import LATENCY_VERBS
from ..verbs.framework import Extender
from .webhook import WebhookConfig, review

log = logging.getLogger("gpupack.extender.http")

DEFAULT_MAX_BODY = 8 * 1024 * 1024
# An AdmissionReview carries the object and, on UPDATE, the old object too. etcd stores an object
# of at most 1.5 MiB (the API server refuses a larger write), so two of them are 3 MiB; the half
# MiB above that is for the review's envelope and JSON's field names, wordier than the stored
# protobuf. A larger body is no review the API server sends: 413 without reading it.
WEBHOOK_MAX_BODY = 3 * 1024 * 1024 + 512 * 1024


_PLAIN_NAMES = re.compile(r"[A-Za-z0-9._:-]*\Z")


def _encode(obj: Any) -> bytes:
    # orjson: a keep-best filter answer names every node (~90 KB at 1,000 nodes); several times
    # faster than the json module, and it holds the GIL for that much less
    return orjson.dumps(obj)


def _encode_scores(names: list[str], scores: list[int]) -> bytes:
    """A prioritize answer (a long list of {Host, Score}) written directly when every host name is
    plain (Kubernetes node names are): several times faster than building and encoding dicts."""
    if _PLAIN_NAMES.match("".join(names)):
        text = ",".join([f'{{"Host":"{n}","Score":{s}}}' for n, s in zip(names, scores, strict=True)])
        return b"[" + text.encode() + b"]"
    return _encode([{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)])


def _json_response(obj: Any, status: int = 200) -> Response:
    text = _encode_scores(*obj) if isinstance(obj, tuple) else _encode(obj)
    return Response(text, status=status, mimetype="application/json")


def _error(status: int, message: str) -> Response:
    return _json_response({"Error": message}, status)


def _body() -> Any:
    data = request.get_data(cache=False)
    if not data:
        raise WireError("empty request body; expected JSON")
    try:
        return orjson.loads(data)
    except (ValueError, RecursionError) as e:
        raise WireError(f"request body is not valid JSON: {e}") from e


def _common(app: Flask, view: ClusterView, metrics: Metrics, max_body: int) -> None:
    app.config["MAX_CONTENT_LENGTH"] = max_body

    @app.errorhandler(WireError)
    def _wire(e: WireError) -> Response:
        return _error(e.status, str(e))

    @app.errorhandler(HTTPException)
    def _http(e: HTTPException) -> Response:
        msg = e.description or e.name
        if e.code == 413:
            msg = f"request body larger than {max_body} bytes"
        return _error(e.code or 400, msg)

    @app.errorhandler(Exception)
    def _crash(e: Exception) -> Response:
        log.exception("unhandled error on %s", request.path)
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    # the listeners answer these on their loop (probes_of), never behind the work queue; the
    # routes below serve what reaches the app itself
    app.extensions["gpupack_ready"] = view.synced.is_set

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok\n", mimetype="text/plain")

    @app.get("/readyz")
    def readyz() -> Response:
        if view.synced.is_set():
            return Response("ok\n", mimetype="text/plain")
        return Response(NOT_READY, status=503, mimetype="text/plain")

    @app.get("/metrics")
    def metrics_() -> Response:
        return Response(render(metrics.registry), mimetype=CONTENT_TYPE_LATEST)


NOT_READY = "waiting for the first full list of nodes and pods\n"


def probes_of(app: Flask, alive: Callable[[], str] | None = None) -> dict[str, Probe]:
    """/healthz and /readyz of `app` (made by create_extender_app or create_webhook_app) as the
    guarded listener answers them on its loop: cheap, non-blocking reads of the app's state.
    `alive`, where given, says why the process is not healthy ("" when it is)."""
    ready: Callable[[], bool] = app.extensions["gpupack_ready"]

    def healthz() -> tuple[int, str]:
        why = alive() if alive is not None else ""
        return (503, why + "\n") if why else (200, "ok\n")

    def readyz() -> tuple[int, str]:
        return (200, "ok\n") if ready() else (503, NOT_READY)

    return {"/healthz": healthz, "/readyz": readyz}


def _freeze_startup_heap() -> None:
    """Move everything allocated so far (imported modules: the Kubernetes client alone is ~60,000
    objects) out of the collector's reach: a full collection then walks only what requests and the
    cluster view allocate, instead of stalling one unlucky request for tens of milliseconds (seen
    as the slowest answers of benchmarks/fuzz_endpoints.py)."""
    gc.collect()
    gc.freeze()


def create_extender_app(ext: Extender, max_body: int = DEFAULT_MAX_BODY) -> Flask:
    """The extender's verbs (answered by `verb_path`) in front of Flask's health, readiness and
    metrics; filter and prioritize mark `ext.activity` while they run."""
    _freeze_startup_heap()
    app = Flask("gpupack-extender")
    _common(app, ext.view, ext.metrics, max_body)
    app.wsgi_app = verb_path(app.wsgi_app, ext, max_body)  # type: ignore[method-assign]
    return app


VERB_PATHS = {"/filter": "filter", "/prioritize": "prioritize", "/bind": "bind"}


def _status(code: int) -> str:
    return f"{code} {HTTP_STATUS_CODES.get(code, 'UNKNOWN').upper()}"


def _read_body(environ: dict[str, Any], max_body: int) -> bytes:
    """The request body, at most `max_body` bytes (413 past that). Without a Content-Length the
    body is read to its end where the server says it is delimited (`wsgi.input_terminated`), and
    is empty otherwise, as PEP 3333 asks. (guarded.py decodes a chunked body and sizes it.)"""
    raw = environ.get("CONTENT_LENGTH")
    stream = environ["wsgi.input"]
    if raw:
        try:
            length = int(raw)
        except ValueError:
            raise WireError(f"Content-Length is not a number: {raw[:40]!r}") from None
        if length > max_body:
            raise WireError(f"request body larger than {max_body} bytes", 413)
        data = stream.read(length) if length > 0 else b""
    elif environ.get("wsgi.input_terminated"):
        data = stream.read(max_body + 1)
        if len(data) > max_body:
            raise WireError(f"request body larger than {max_body} bytes", 413)
    else:
        data = b""
    if not data:
        raise WireError("empty request body; expected JSON")
    return bytes(data)


def verb_path(inner: Callable[..., Any], ext: Extender, max_body: int) -> Callable[..., Any]:
    """The WSGI app `inner` with the verbs (POST /filter, /prioritize, /bind) answered here, and
    only here: body → parse → the Extender's method → JSON answer, without Flask's request and
    response objects around them (under a burst those took about as long as the verb itself on a
    CPU shared with binds and watch events, and kube-scheduler waits for every filter).

    Each verb is timed from its start to its answer (`gpupack_extender_request_seconds`) and from
    its whole body in hand (`..._answer_seconds`), and tells the caller as `Server-Timing`.
    A request the client got wrong is a 4xx with a one-line reason (counted in
    `..._bad_requests_total`); anything else is logged and answered 500, never raised into the
    server. Filter and prioritize mark `ext.activity` while they run (collector.LATENCY_VERBS)."""
    metrics, activity = ext.metrics, ext.activity

    def require_synced() -> None:
        if not ext.view.synced.is_set():
            raise WireError("gpupack extender has not finished its first sync with the API server", 503)

    def filter_verb(body: Any) -> Any:
        args = parse_extender_args(body)
        require_synced()
        return ext.filter(args)

    def prioritize_verb(body: Any) -> Any:
        args = parse_extender_args(body)
        require_synced()
        return ext.scores_for(args)  # (names, scores): encoded without building dicts

    def bind_verb(body: Any) -> Any:
        args = parse_bind_args(body)
        require_synced()
        return ext.bind(args)

    runs: dict[str, Callable[[Any], Any]] = {
        "filter": filter_verb,
        "prioritize": prioritize_verb,
        "bind": bind_verb,
    }

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        verb = VERB_PATHS.get(environ.get("PATH_INFO", ""))
        if verb is None:
            return inner(environ, start_response)
        headers = [("Content-Type", "application/json")]
        if environ.get("REQUEST_METHOD") != "POST":
            text = _encode({"Error": "The method is not allowed for the requested URL."})
            headers += [("Allow", "POST"), ("Content-Length", str(len(text)))]
            start_response(_status(405), headers)
            return [text]
        t0 = time.perf_counter()
        watched = verb in LATENCY_VERBS
        if watched:
            activity.enter()
        try:
            data = _read_body(environ, max_body)
            t1 = time.perf_counter()
            try:
                body = orjson.loads(data)
            except (ValueError, RecursionError) as e:
                raise WireError(f"request body is not valid JSON: {e}") from e
            out = runs[verb](body)
            text = _encode_scores(*out) if isinstance(out, tuple) else _encode(out)
            status = 200
            t2 = time.perf_counter()
            dt = t2 - t0
            metrics.latency.labels(verb).observe(dt)
            metrics.answer.labels(verb).observe(t2 - t1)
            headers.append(("Server-Timing", f"{verb};dur={dt * 1000:.3f}"))
        except WireError as e:
            metrics.bad_requests.labels(verb).inc()
            metrics.latency.labels(verb).observe(time.perf_counter() - t0)
            status, text = e.status, _encode({"Error": str(e)})
        except Exception as e:
            log.exception("unhandled error on %s", environ.get("PATH_INFO"))
            status, text = 500, _encode({"Error": f"internal error: {type(e).__name__}: {e}"})
        finally:
            if watched:
                activity.leave()
        headers.append(("Content-Length", str(len(text))))
        start_response(_status(status), headers)
        return [text]

    return wsgi


PROBE_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})


def only_probes(app: Callable[..., Any]) -> Callable[..., Any]:
    """`app` (WSGI) answering PROBE_PATHS only: what the metrics listener, open to the network,
    serves; the verbs stay on the loopback listener, which serves `app` itself."""

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") not in PROBE_PATHS:
            body = _encode({"Error": "only /metrics, /healthz and /readyz are served on this port"})
            start_response(
                "404 NOT FOUND", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        return app(environ, start_response)

    return wsgi


def create_webhook_app(
    cfg: WebhookConfig, view: ClusterView, metrics: Metrics, max_body: int = WEBHOOK_MAX_BODY
) -> Flask:
    _freeze_startup_heap()
    app = Flask("gpupack-webhook")
    _common(app, view, metrics, max_body)

    @app.errorhandler(Exception)
    def _crash(e: Exception) -> Response:
        # the webhook's callers are unauthenticated: the error stays in the log
        log.exception("unhandled error on %s", request.path)
        return _error(500, "internal error")

    def handle(kind: str) -> Response:
        t0 = time.perf_counter()
        try:
            out = review(_body(), kind, cfg, view.largest_gpu_mib())
        except WireError:
            metrics.bad_requests.labels(kind).inc()
            raise
        finally:
            metrics.latency.labels(kind).observe(time.perf_counter() - t0)
        resp = out["response"]
        result = "allowed" if resp.get("allowed") else "denied"
        if resp.get("patch"):
            result = "patched"
        metrics.admission.labels(kind, result).inc()
        return _json_response(out)

    @app.post("/mutate")
    def mutate() -> Response:
        return handle("mutate")

    @app.post("/validate")
    def validate() -> Response:
        return handle("validate")

    return app
