"""A small API server for the certificate tests: Secrets and webhook configurations.

The project's in-test API server does not serve these two resources, so this one does, with the
semantics gpupack.certs depends on: AlreadyExists (409) on a second create, Conflict (409) on a
PUT whose resourceVersion is stale, NotFound (404), all as `Status` objects, over real HTTP for the
official client.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_SECRETS = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?$")
_WEBHOOKS = re.compile(r"^/apis/admissionregistration\.k8s\.io/v1/(mutating|validating)webhookconfigurations(?:/([^/]+))?$")
_KIND = {"mutating": "MutatingWebhookConfiguration", "validating": "ValidatingWebhookConfiguration"}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class CertsAPIServer:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (type, ns, name) -> obj
        self.rv = 0
        self.writes: list[tuple[str, str]] = []  # (method, path) of successful writes
        # Called (once) just before a Secret create is applied: lets a test play "the other replica".
        self.before_secret_create: Callable[[], None] | None = None
        self._httpd: ThreadingHTTPServer | None = None

    # --- store ----------------------------------------------------------------------------
    def put(self, typ: str, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.rv += 1
            obj = copy.deepcopy(obj)
            md = obj.setdefault("metadata", {})
            md["resourceVersion"] = str(self.rv)
            md.setdefault("uid", str(uuid.uuid4()))
            md.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            if ns:
                md["namespace"] = ns
            self.objects[(typ, ns, md["name"])] = obj
            return copy.deepcopy(obj)

    def get(self, typ: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            o = self.objects.get((typ, ns, name))
            return copy.deepcopy(o) if o else None

    # --- HTTP -----------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        m = _SECRETS.match(path)
        if m:
            typ, ns, name, kind, api = "secrets", m.group(1), m.group(2), "Secret", "v1"
        else:
            m = _WEBHOOKS.match(path)
            if not m:
                return 404, _status(404, "NotFound", f"the server could not find the requested resource ({path})")
            typ, ns, name, kind = m.group(1), "", m.group(2), _KIND[m.group(1)]
            api = "admissionregistration.k8s.io/v1"
        if method == "GET" and name:
            o = self.get(typ, ns, name)
            if o is None:
                return 404, _status(404, "NotFound", f'{typ} "{name}" not found')
            return 200, o
        if method == "POST" and not name:
            if not isinstance(body, dict) or not body.get("metadata", {}).get("name"):
                return 422, _status(422, "Invalid", "metadata.name: Required value")
            if typ == "secrets" and self.before_secret_create is not None:
                hook, self.before_secret_create = self.before_secret_create, None
                hook()
            new = body["metadata"]["name"]
            if self.get(typ, ns, new) is not None:
                return 409, _status(409, "AlreadyExists", f'{typ} "{new}" already exists')
            body.update(kind=kind, apiVersion=api)
            self.writes.append((method, path))
            return 201, self.put(typ, ns, body)
        if method == "PUT" and name:
            cur = self.get(typ, ns, name)
            if cur is None:
                return 404, _status(404, "NotFound", f'{typ} "{name}" not found')
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv and rv != cur["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", f'Operation cannot be fulfilled on {typ} "{name}": '
                                    "the object has been modified; please apply your changes to the latest "
                                    "version and try again")
            body.update(kind=kind, apiVersion=api)
            body["metadata"]["uid"] = cur["metadata"]["uid"]
            self.writes.append((method, path))
            return 200, self.put(typ, ns, body)
        return 405, _status(405, "MethodNotAllowed", f"{method} not allowed on {path}")

    def start(self) -> CertsAPIServer:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a: Any) -> None:
                pass

            def _do(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    code, out = 400, _status(400, "BadRequest", "invalid JSON")
                else:
                    code, out = api.handle(self.command, self.path.split("?")[0], body)
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _do

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd:
            self._httpd.shutdown()
            self._httpd.server_close()

    @property
    def url(self) -> str:
        assert self._httpd
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def kubeconfig(self) -> str:
        return kubeconfig_for(self.url)


def kubeconfig_for(url: str) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": url}}],
        "users": [{"name": "t", "user": {"token": "x"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
    })
