"""One Kubernetes client layer for every component: the kubeconfig loader, the ApiClient's
settings, and the helpers every caller of the API needs (raw JSON, bounded calls, error text).

Loading: `--kubeconfig FILE` when given; else the pod's service account (in-cluster); else
$KUBECONFIG or ~/.kube/config. A `--kubeconfig` whose user names a `tokenFile` has that file
re-read whenever it changes (as client-go does): the extender's token is minted for it by
`python -m gpupack.token` and replaced well before it expires. Each call builds its own Configuration, so two clients in one
process (a test's and a component's) never share the library's global default.

Calls are made with `_preload_content=False` and parsed as API JSON (camelCase dicts, what
gpupack.contract and gpupack.handoff read): the client's model deserialisation costs more than
the work done with the objects. Every call is bounded (`timeout_s`): an API server that stops
answering must fail a call, never hang a component.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

MERGE_PATCH = "application/merge-patch+json"
DEFAULT_TIMEOUT_S = 30.0
PAGE = 500

__all__ = [
    "DEFAULT_TIMEOUT_S", "MERGE_PATCH", "ApiException", "KubeClient", "KubeConfigError", "api_client",
    "api_reason", "bounded", "is_status", "load_config", "read_json", "request_json", "throttled",
]  # fmt: skip


class KubeConfigError(config.ConfigException):
    """No usable credentials: the message says which source failed and why. A ConfigException, so
    callers written against the library's loader catch it unchanged."""


def load_config(kubeconfig: str | None = None) -> client.Configuration:
    """The client configuration: `kubeconfig` if given, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
    cfg = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
    except (config.ConfigException, OSError, ValueError, TypeError) as e:
        # TypeError/ValueError: a kubeconfig that is YAML but not a kubeconfig
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster or default kubeconfig"
        raise KubeConfigError(f"cannot configure the Kubernetes client ({where}): {e}") from e
    token_file = _token_file(kubeconfig) if kubeconfig else ""
    if token_file:
        _follow_token_file(cfg, token_file)
    elif cfg.refresh_api_key_hook is not None:
        cfg.refresh_api_key_hook = throttled(cfg.refresh_api_key_hook, HOOK_EVERY_S)
    return cfg


# The library's own credential hook (an inline or exec token, in-cluster) runs before every request
# and sets the host, CA and token again each time: ~a fifth of a small request's client CPU (a
# Binding). Its only work that changes anything is reloading a token once it has expired (in-cluster:
# re-reading the token file each minute), which at most once a second still does.
HOOK_EVERY_S = 1.0


def throttled(
    hook: Callable[[client.Configuration], None], every_s: float, clock: Callable[[], float] = time.monotonic
) -> Callable[[client.Configuration], None]:
    """`hook`, run at most once every `every_s` seconds (the first call runs it). The library's hook
    installs itself again each time it runs (kube_config's _set_config): whatever hook it installs
    is the one run next time, and this one stays in its place."""
    last = [-math.inf]
    inner = [hook]

    def call(c: client.Configuration) -> None:
        now = clock()
        if now - last[0] < every_s:
            return
        last[0] = now
        inner[0](c)
        installed = getattr(c, "refresh_api_key_hook", call)
        if installed is not call and installed is not None:
            inner[0] = installed
            c.refresh_api_key_hook = call

    return call


def _token_file(kubeconfig: str) -> str:
    """The current context's user's `tokenFile` (relative to the kubeconfig's folder), or ""."""
    try:
        with open(kubeconfig) as f:
            doc = yaml.safe_load(f) or {}
        ctx_name = doc.get("current-context")
        ctx = next(c["context"] for c in doc.get("contexts") or [] if c.get("name") == ctx_name)
        user = next(u.get("user") or {} for u in doc.get("users") or [] if u.get("name") == ctx.get("user"))
    except (OSError, yaml.YAMLError, StopIteration, KeyError, TypeError, AttributeError):
        return ""  # load_kube_config accepted it: a layout this reader does not know has no tokenFile
    path = user.get("tokenFile") if isinstance(user, dict) and not user.get("token") else None
    if not isinstance(path, str) or not path:
        return ""
    return os.path.join(os.path.dirname(os.path.abspath(kubeconfig)), path)


def _follow_token_file(cfg: client.Configuration, path: str) -> None:
    """Re-read `path` on the first request after it changed. The library reads a kubeconfig's
    tokenFile once; a bound token expires, and its minter replaces the file (a rename, so a
    reader never sees half a token). A stat per request costs about a microsecond."""
    lock = threading.Lock()
    seen: list[tuple[int, int]] = [(-1, -1)]

    def refresh(c: client.Configuration) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return  # keep the token in hand: the API server says whether it is still good
        key = (st.st_ino, st.st_mtime_ns)
        if key == seen[0]:
            return
        with lock:
            try:
                with open(path) as f:
                    token = f.read().strip()
            except OSError:
                return
            if token:
                c.api_key["BearerToken"] = f"Bearer {token}"
                seen[0] = key

    refresh(cfg)
    cfg.refresh_api_key_hook = refresh


def api_client(kubeconfig: str | None = None, connections: int = 0, retries: int = 0) -> client.ApiClient:
    """An ApiClient over load_config(kubeconfig).

    `retries` 0: urllib3 would retry a timed-out request three times on its own, so a 3 s timeout
    became 12 s; every gpupack caller retries at its own level (watch loops, the scheduler's
    retry of a bind, the kubelet's of an admission). `connections`: the connection pool's size,
    at least the caller's concurrent requests (urllib3's default pool opens and throws away a new
    TLS connection per call beyond it)."""
    cfg = load_config(kubeconfig)
    cfg.retries = retries
    if connections:
        cfg.connection_pool_maxsize = connections
    return client.ApiClient(cfg)


def read_json(resp: Any) -> dict[str, Any]:
    """The JSON body of a `_preload_content=False` response."""
    out = json.loads(resp.data)
    if not isinstance(out, dict):
        raise ApiException(status=500, reason=f"the API server answered with a JSON {type(out).__name__}")
    return out


def request_json(
    api: client.ApiClient,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """`method path` with a JSON body, answered with JSON, without the typed API classes: for a
    caller that makes a few requests to paths of its own (gpupack.certs). Raises ApiException for a
    non-2xx answer, ValueError for an answer that is not a JSON object."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    m, url, hdrs, b, _ = api.param_serialize(
        method=method, resource_path=path, header_params=headers, body=body, auth_settings=["BearerToken"]
    )
    resp = api.call_api(m, url, header_params=hdrs, body=b, _request_timeout=timeout_s)
    data = resp.read()
    if not 200 <= resp.status <= 299:
        raise ApiException.from_response(http_resp=resp, body=data.decode(errors="replace"), data=None)
    try:
        out = json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"{method} {path}: the API server answered with non-JSON ({e})") from e
    if not isinstance(out, dict):
        raise ValueError(f"{method} {path}: the API server answered with a JSON {type(out).__name__}")
    return out


def is_status(e: BaseException, *codes: int) -> bool:
    return isinstance(e, ApiException) and e.status in codes


def api_reason(e: ApiException) -> str:
    """`STATUS message`: the API server's own message (from the Status body) when it sent one."""
    try:
        msg = json.loads(e.body or "{}").get("message")
    except (ValueError, AttributeError):
        msg = None
    return f"{e.status} {msg or e.reason}"


def bounded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` failing as an ApiException (status 504) when the API server does not answer in time or
    the connection fails, so that callers handle one exception type for every API failure."""

    def call(*a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except (HTTPError, OSError) as e:
            raise ApiException(
                status=504, reason=f"API call failed or timed out: {type(e).__name__}: {e}"
            ) from e

    return call


class KubeClient:
    """One ApiClient and the typed APIs over it. `json` makes a call bounded by `timeout_s` and
    returns the API's JSON; `pages`/`list_all` page through a list call."""

    def __init__(self, api: client.ApiClient, timeout_s: float = DEFAULT_TIMEOUT_S, page: int = PAGE) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.page = page
        self.core = client.CoreV1Api(api)
        self.policy = client.PolicyV1Api(api)
        self.coordination = client.CoordinationV1Api(api)

    @classmethod
    def from_kubeconfig(
        cls, kubeconfig: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> KubeClient:
        return cls(api_client(kubeconfig), timeout_s)

    def json(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> dict[str, Any]:
        kw.setdefault("_request_timeout", self.timeout_s)
        return read_json(bounded(fn)(*a, _preload_content=False, **kw))

    def merge_patch(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> dict[str, Any]:
        """`fn` (a patch_* call) as a JSON merge patch: a `metadata.resourceVersion` in the body
        makes it fail with 409 if the object changed since that version."""
        return self.json(fn, *a, _content_type=MERGE_PATCH, **kw)

    def pages(
        self, list_fn: Callable[..., Any], *a: Any, **kw: Any
    ) -> Iterator[tuple[list[dict[str, Any]], str]]:
        """(items, resourceVersion) per page of a list call, `self.page` items at a time."""
        cont = ""
        while True:
            raw = self.json(list_fn, *a, limit=self.page, _continue=cont or None, **kw)
            meta = raw.get("metadata") or {}
            yield list(raw.get("items") or []), str(meta.get("resourceVersion") or "")
            cont = str(meta.get("continue") or "")
            if not cont:
                return

    def list_all(self, list_fn: Callable[..., Any], *a: Any, **kw: Any) -> list[dict[str, Any]]:
        return [item for items, _rv in self.pages(list_fn, *a, **kw) for item in items]
