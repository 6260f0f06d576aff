"""Label and field selectors with the string syntax and matching rules of apimachinery."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ApiError, bad_request

# (key, operator, values); operators: = != in notin exists !
Requirement = tuple[str, str, frozenset[str]]

_SET_TERM = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s+(in|notin)\s*\((.*)\)\s*$")
_KEY = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside `( ... )`."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t.strip() for t in terms if t.strip()]


def _check_key(key: str, term: str) -> str:
    if not _KEY.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
        raise bad_request(f"unable to parse requirement: invalid label key {key!r} in {term!r}")
    return key


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text or not text.strip():
        return []
    reqs: list[Requirement] = []
    for term in _split_terms(text):
        m = _SET_TERM.match(term)
        if m:
            if m.group(1):
                raise bad_request(f"unable to parse requirement: {term!r}")
            values = frozenset(v.strip() for v in m.group(4).split(",") if v.strip())
            reqs.append((_check_key(m.group(2), term), m.group(3), values))
        elif term.startswith("!"):
            reqs.append((_check_key(term[1:].strip(), term), "!", frozenset()))
        elif "!=" in term:
            k, v = term.split("!=", 1)
            reqs.append((_check_key(k.strip(), term), "!=", frozenset({v.strip()})))
        elif "==" in term:
            k, v = term.split("==", 1)
            reqs.append((_check_key(k.strip(), term), "=", frozenset({v.strip()})))
        elif "=" in term:
            k, v = term.split("=", 1)
            reqs.append((_check_key(k.strip(), term), "=", frozenset({v.strip()})))
        elif any(c in term for c in "<>()"):
            raise bad_request(f"unable to parse requirement: {term!r}")
        else:
            reqs.append((_check_key(term, term), "exists", frozenset()))
    return reqs


def labels_match(reqs: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    for key, op, values in reqs:
        present = key in labels
        if op == "=" or op == "in":
            if not present or labels[key] not in values:
                return False
        elif op in ("!=", "notin"):
            if present and labels[key] in values:
                return False
        elif op == "exists":
            if not present:
                return False
        elif op == "!" and present:
            return False
    return True


def selector_from_object(selector: Mapping[str, Any] | None) -> list[Requirement] | None:
    """A metav1.LabelSelector (matchLabels/matchExpressions) as requirements; None matches nothing."""
    if selector is None:
        return None
    reqs: list[Requirement] = [
        (k, "=", frozenset({str(v)})) for k, v in (selector.get("matchLabels") or {}).items()
    ]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expr in selector.get("matchExpressions") or []:
        op = ops.get(expr.get("operator", ""))
        if op is None:
            raise ApiError(422, f"invalid label selector operator {expr.get('operator')!r}")
        reqs.append((expr.get("key", ""), op, frozenset(expr.get("values") or [])))
    return reqs


# --- field selectors ---------------------------------------------------------------------------

FieldRequirement = tuple[str, bool, str]  # (field, equal?, value)


def parse_field_selector(text: str | None, allowed: tuple[str, ...]) -> list[FieldRequirement]:
    if not text or not text.strip():
        return []
    reqs: list[FieldRequirement] = []
    for term in _split_terms(text):
        if "!=" in term:
            f, v = term.split("!=", 1)
            eq = False
        elif "==" in term:
            f, v = term.split("==", 1)
            eq = True
        elif "=" in term:
            f, v = term.split("=", 1)
            eq = True
        else:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        f = f.strip()
        if f not in allowed:
            raise bad_request(f"field label not supported: {f}")
        reqs.append((f, eq, v.strip()))
    return reqs


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string form the real field-label converters produce ("" for unset, bools lowercase)."""
    if path == "source":  # core/v1 Event: source means source.component
        path = "source.component"
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return ""
        cur = cur.get(part)
    if cur is None:
        return "false" if path in ("spec.unschedulable", "spec.hostNetwork") else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def fields_match(reqs: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, path) == value) == eq for path, eq, value in reqs)


def make_filter(
    label_reqs: list[Requirement], field_reqs: list[FieldRequirement]
) -> Callable[[Mapping[str, Any]], bool] | None:
    if not label_reqs and not field_reqs:
        return None

    def matches(obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        return labels_match(label_reqs, meta.get("labels")) and fields_match(field_reqs, obj)

    return matches
