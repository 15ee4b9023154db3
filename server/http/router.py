"""A listener's routing table, decided once when the listener is built.

- A method + path template claimed by two routes fails at start-up (`RouteClash`), unless one
  route `overrides` the other's owner (it replaces it on a listener both land on), or the path
  is shared by body: one route without a `claim` (the default) and others with claims on the
  decoded JSON body, tried in order (MindIE's `/generate` with `prompt` vs TGI's, SageMaker's
  `/invocations`, vLLM's `/tokenize` vs TGI's).
- Matching: static paths by one dict lookup, templates by the regexes of their first segment.
  The result carries the route's endpoint, owner, access class and error renderer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from server.core.errors import EngineError, GatewayError
from server.core.frozen import quick_init
from server.http import jsonio
from server.http.body import read_body
from server.http.context import BODY_ERROR_KEY, BODY_KEY, OWNER_KEY
from server.http.routes import Access, Answer, Claim, Endpoint, Render, Route

logger = logging.getLogger("gateway.http")
_PARAM = re.compile(r"{([a-zA-Z_][a-zA-Z0-9_]*)(:path)?}")


class RouteClash(ValueError):
    """Two routes claim one method and path and nothing says which one wins."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """What a request resolves to."""

    endpoint: Endpoint
    owner: str
    template: str
    access: Access
    render: Render


@quick_init
@dataclass(frozen=True, slots=True)
class Resolution:
    """`entry` with its path parameters; or, when only the method differs, a route of that
    path (for its access class and error shape) and the methods it allows; or nothing."""

    entry: Entry | None
    params: dict[str, str] = field(default_factory=dict)
    allowed: tuple[str, ...] = ()


_MISS = Resolution(None)


@dataclass(slots=True)
class _Template:
    path: str
    regex: re.Pattern[str]
    methods: dict[str, Entry]


class Router:
    def __init__(self, routes: Sequence[Route], *, max_body_bytes: int) -> None:
        self._static: dict[str, dict[str, Entry]] = {}
        # a static path's resolution per method, built once (every request resolves one)
        self._resolved: dict[tuple[str, str], Resolution] = {}
        self._templates: dict[str, list[_Template]] = {}
        by_path: dict[str, dict[str, Entry]] = {}
        for (method, path), entry in _entries(routes, max_body_bytes).items():
            by_path.setdefault(path, {})[method] = entry
        for path, methods in by_path.items():
            _add_head(methods)
            if "{" in path:
                first = _first_segment(path)
                if "{" in first:
                    raise ValueError(f"{path}: a template must start with a literal segment")
                template = _Template(path, _compile(path), methods)
                self._templates.setdefault(first, []).append(template)
            else:
                self._static[path] = methods
        for templates in self._templates.values():  # more literal text first: most specific
            templates.sort(key=lambda t: -len(_PARAM.sub("", t.path)))
        for path, methods in self._static.items():
            for method, entry in methods.items():
                self._resolved[method, path] = Resolution(entry)

    def resolve(self, method: str, path: str) -> Resolution:
        resolved = self._resolved.get((method, path))
        if resolved is not None:
            return resolved
        methods = self._static.get(path)
        params: dict[str, str] = {}
        if methods is None:
            found = self._match_template(path)
            if found is None:
                return _MISS
            methods, params = found
        entry = methods.get(method)
        if entry is not None:
            return Resolution(entry, params)
        return Resolution(next(iter(methods.values())), params, tuple(sorted(methods)))

    def knows(self, path: str) -> bool:
        return path in self._static or self._match_template(path) is not None

    def _match_template(self, path: str) -> tuple[dict[str, Entry], dict[str, str]] | None:
        for template in self._templates.get(_first_segment(path), ()):
            match = template.regex.fullmatch(path)
            if match is not None:
                return template.methods, match.groupdict()
        return None


def _entries(routes: Sequence[Route], max_body_bytes: int) -> dict[tuple[str, str], Entry]:
    """One entry per method and path; raises `RouteClash`."""
    groups: dict[tuple[str, str], list[Route]] = {}
    seen: set[int] = set()
    for route in routes:
        if id(route) in seen:  # one route on two listeners that share a port
            continue
        seen.add(id(route))
        groups.setdefault((route.method, _shape(route.path)), []).append(route)
    return {
        (method, group[0].path): _entry(_winners(group), max_body_bytes)
        for (method, _), group in groups.items()
    }


def _winners(group: list[Route]) -> list[Route]:
    overridden = {owner for route in group for owner in route.overrides}
    return [route for route in group if route.owner not in overridden]


def _entry(group: list[Route], max_body_bytes: int) -> Entry:
    """One route, or a shared path: the route without a claim is the default (with none, the
    first claimant is); two routes without a claim clash."""
    if len(group) == 1:
        return _plain(group[0])
    defaults = [route for route in group if route.claim is None]
    if len(defaults) > 1:
        owners = ", ".join(sorted({route.owner for route in defaults}))
        raise RouteClash(
            f"{group[0].method} {group[0].path} is claimed by {owners}: declare body claims on "
            "all routes but one, or an override"
        )
    default = defaults[0] if defaults else group[0]
    claimed = [route for route in group if route is not default]
    return Entry(
        endpoint=_by_body(default, claimed, max_body_bytes),
        owner=default.owner,
        template=default.path,
        access=default.access,
        render=default.render,
    )


def _plain(route: Route) -> Entry:
    return Entry(
        endpoint=route.endpoint,
        owner=route.owner,
        template=route.path,
        access=route.access,
        render=route.render,
    )


def _by_body(default: Route, claimed: list[Route], max_body_bytes: int) -> Endpoint:
    """Read the body once; the first claimant that accepts it gets the request, else the
    default. A body that cannot be read goes to the default, which reports the error."""

    async def dispatch(request: Request) -> Answer:
        try:
            body = await read_body(request, max_body_bytes)
        except GatewayError as exc:
            request.scope[BODY_ERROR_KEY] = exc
            return await default.endpoint(request)
        request.scope[BODY_KEY] = body
        try:
            data: object = jsonio.loads(body) if body.strip() else None
        except (jsonio.JSONDecodeError, GatewayError):  # the default route reports it
            data = None
        chosen = next((r for r in claimed if r.claim is not None and r.claim(data)), default)
        request.scope[OWNER_KEY] = chosen.owner
        if chosen is default:
            return await default.endpoint(request)
        return await guarded(chosen.endpoint, chosen.render, request)

    return dispatch


async def guarded(endpoint: Endpoint, render: Render, request: Request) -> Answer:
    """Run an endpoint; a domain error becomes its route's error answer. Anything else is a bug:
    it is logged with its traceback and answered as a generic error (no internals leak)."""
    try:
        return await endpoint(request)
    except GatewayError as exc:
        return render(exc)
    except Exception:
        logger.exception("unexpected error in %s %s", request.method, request.scope["path"])
        return render(EngineError("Internal error while handling the request"))


def has_key(key: str) -> Claim:
    """A claim: the body is a JSON object with a non-null `key`."""
    return lambda data: isinstance(data, dict) and data.get(key) is not None


def _add_head(methods: dict[str, Entry]) -> None:
    if "GET" in methods and "HEAD" not in methods:
        methods["HEAD"] = methods["GET"]


def _compile(path: str) -> re.Pattern[str]:
    pattern, end = "", 0
    for match in _PARAM.finditer(path):
        pattern += re.escape(path[end : match.start()])
        name, is_path = match.group(1), match.group(2)
        # an empty name names nothing: `/v1/models/` is the listing's path with a slash
        pattern += f"(?P<{name}>.+)" if is_path else f"(?P<{name}>[^/]+)"
        end = match.end()
    return re.compile(pattern + re.escape(path[end:]))


def _shape(path: str) -> str:
    """The path with parameter names erased: two templates of one shape clash."""
    return _PARAM.sub(lambda m: "{}" if m.group(2) is None else "{:path}", path)


def _first_segment(path: str) -> str:
    parts = path.split("/", 2)
    return parts[1] if len(parts) > 1 else ""
