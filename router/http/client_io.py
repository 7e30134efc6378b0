"""The client side of an aiohttp handler: its body read under a byte limit, a rejection answered."""

from __future__ import annotations

from aiohttp import web

from router.request.rejections import Answer, BodyTooLarge


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, or ``BodyTooLarge`` (declared or actual size over ``limit``).

    The application must be built with ``client_max_size=limit + 1`` so aiohttp reads a body of
    exactly the limit and stops one byte later.
    """
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"request body is over the limit of {limit} bytes") from None
    if len(raw) > limit:
        raise BodyTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
    return raw


def answer_response(answer: Answer) -> web.Response:
    return web.Response(status=answer.status, body=answer.body, headers=answer.headers)
