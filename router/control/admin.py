"""HTTP views of the control plane, served on the metrics listener.

* ``GET /debug/pool`` (read-only): every group with its state, epoch, members, each check's
  result and duration, and the last failure; behind ``admin.token`` when one is set (it names
  every pod's address).
* ``POST /admin/groups/{key}/{drain|undrain|regate}`` (only with ``admin.enabled``): each needs
  ``Authorization: Bearer <admin.token>``; a wrong or missing token is 401, an unknown group 404.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from router.control.groups import GroupController
from router.http.server import bearer_ok

log = logging.getLogger(__name__)

VERBS = ("drain", "undrain", "regate")


def control_routes(
    controller: GroupController, admin_token: str | None, debug_token: str | None = None
) -> list[web.RouteDef]:
    """The debug view (behind ``debug_token`` when set), plus the admin verbs when
    ``admin_token`` is set."""

    async def pool_view(request: web.Request) -> web.Response:
        if not bearer_ok(request, debug_token):
            return _json(401, {"error": "debug view: missing or wrong bearer token"})
        return _json(200, controller.view())

    async def admin(request: web.Request) -> web.Response:
        assert admin_token is not None
        if not bearer_ok(request, admin_token):
            return _json(401, {"error": "admin API: missing or wrong bearer token"})
        key, verb = request.match_info["key"], request.match_info["verb"]
        if verb not in VERBS:
            return _json(404, {"error": f"unknown verb {verb!r}; one of {list(VERBS)}"})
        if key not in controller.groups:
            return _json(404, {"error": f"no group {key!r}"})
        getattr(controller, verb)(key)
        log.info("admin: %s group %s", verb, key)
        return _json(200, {"group": key, "state": controller.groups[key].state.value})

    routes = [web.get("/debug/pool", pool_view)]
    if admin_token is not None:
        routes.append(web.post("/admin/groups/{key}/{verb}", admin))
    return routes


def _json(status: int, value: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), content_type="application/json")
