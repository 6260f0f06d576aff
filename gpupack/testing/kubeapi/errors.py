"""API errors rendered as the `Status` objects the real kube-apiserver returns."""

from __future__ import annotations

from typing import Any

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An error the server answers with a `Status` body and HTTP `code`."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        return status_object(self.code, "Failure", self.message, self.reason, self.details)


def status_object(
    code: int,
    status: str = "Success",
    message: str | None = None,
    reason: str | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    obj: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": status}
    if message is not None:
        obj["message"] = message
    if reason is not None:
        obj["reason"] = reason
    if details:
        obj["details"] = details
    obj["code"] = code
    return obj


def _details(group: str, plural: str, name: str, **extra: Any) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": plural}
    if group:
        details["group"] = group
    details.update(extra)
    return details


def _qualified(group: str, plural: str) -> str:
    return f"{plural}.{group}" if group else plural


def not_found(group: str, plural: str, name: str) -> ApiError:
    return ApiError(
        404, f'{_qualified(group, plural)} "{name}" not found', "NotFound", _details(group, plural, name)
    )


def already_exists(group: str, plural: str, name: str) -> ApiError:
    return ApiError(
        409,
        f'{_qualified(group, plural)} "{name}" already exists',
        "AlreadyExists",
        _details(group, plural, name),
    )


def conflict(group: str, plural: str, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {_qualified(group, plural)} "{name}": {why}',
        "Conflict",
        _details(group, plural, name),
    )


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(group: str, kind: str, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """422 Invalid; `causes` are (field, message) pairs as in field.ErrorList."""
    text = ", ".join(f"{f}: {m}" for f, m in causes)
    message = (
        f'{kind} "{name}" is invalid: {text}' if len(causes) == 1 else f'{kind} "{name}" is invalid: [{text}]'
    )
    details: dict[str, Any] = {"name": name, "kind": kind}
    if group:
        details["group"] = group
    details["causes"] = [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes]
    return ApiError(422, message, "Invalid", details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")


def method_not_allowed(method: str) -> ApiError:
    return ApiError(
        405, f"the server does not allow this method on the requested resource ({method})", "MethodNotAllowed"
    )


def path_not_found() -> ApiError:
    return ApiError(404, "the server could not find the requested resource", "NotFound", {})


def expired(requested: int, oldest: int) -> ApiError:
    return ApiError(410, f"too old resource version: {requested} ({oldest})", "Expired")
