"""The Responses API's state, kept by the proxy rather than by any one worker.

    POST /v1/responses  previous_response_id ─▶ the stored conversation + this input, sent whole
                        store (default true) ─▶ the answer stored for the turns that follow
                        background: true ────▶ answered `queued` at once; generated meanwhile
    GET    /v1/responses/{id}               the stored response
    GET    /v1/responses/{id}/input_items   the input it answered, turns before it included
    DELETE /v1/responses/{id}
    POST   /v1/responses/{id}/cancel        a background response still generating: stopped at
                                            its worker (the connection closes; vLLM aborts),
                                            by whichever replica runs it

A background response's router holds it while generating (renewing a hold that expires in
HOLD seconds). If that router dies (a replica killed), any replica that reads the response
finds it generating and unheld, and stores it as failed: a client polling it gets an end. (A
router stalled past HOLD that then finishes stores its answer over that failure.)

vLLM's own store is per server, in memory, unbounded and off by default, so a chain that relied
on it would die with the worker that served its last turn. Here any worker can serve any turn:
the turn is sent whole, and the prefix index, not a pin, finds the worker holding its KV.

Each response belongs to whoever made it (`owner_of`: the tenant, or without tenants the API
key's pseudonym); another owner's id answers as a missing one does. With router replicas the
store is their Redis (conversations.py): a turn may reach any replica. When that store is down,
a turn that continues a stored response gets a 503 that says so; a turn that does not goes on
(its answer is not stored, and that is logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import orjson
from aiohttp import web

from router.proxy.conversations import RESPONSES, Responses, Stored, StoreUnavailable
from router.proxy.errors import APIError, bad_request
from router.proxy.forward import SETTINGS
from router.proxy.identity import authenticate, client_identity

log = logging.getLogger(__name__)

MAX_ID = 128  # characters: the ids made here are 37
# Background responses still generating at this router: id -> (owner, task).
BACKGROUND = web.AppKey("background_responses", dict)
# This router listening for stops the other replicas ask for, once it runs a background
# response: "task", and "ready" (set while listening).
CANCELS = web.AppKey("cancel_listener", dict)
LISTEN_WAIT = 2.0  # seconds a background response waits for its router to listen for stops
CANCEL_WAIT = 5.0  # seconds a stop asked of another replica may take to show in the store
HOLD = 10.0  # seconds a background response's hold lasts unless its router renews it
RENEW_EVERY = HOLD / 4  # a renewal may fail or come late twice before the hold lapses
GENERATING = ("queued", "in_progress")  # a background response's statuses until it ends


def owner_of(http: web.Request, tenant: object = None) -> str:
    """Who a stored response belongs to: what `client_identity` makes of the request's
    headers alone (the tenant; else a trusted gateway's client; else the API key's
    pseudonym; else anonymous), so a GET finds what a POST stored."""
    s = http.app[SETTINGS]
    if tenant is None:
        tenant = authenticate(http, s)
    return client_identity(http, {}, tenant, s)[0]  # type: ignore[arg-type]


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def as_items(value: object) -> list:
    """A Responses `input` as a list of items (text: one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


async def expand(http: web.Request, body: dict, owner: str) -> dict:
    """`body` with its `previous_response_id` expanded: the stored conversation, then this
    input. The body as it is when it continues nothing."""
    previous = body.get("previous_response_id")
    if previous is None:
        return body
    if not isinstance(previous, str) or not previous:
        raise bad_request("'previous_response_id' must be a response id", "previous_response_id")
    if not isinstance(body.get("input"), (str, list)):
        raise bad_request("'input' must be a string or a list of items", "input")
    store: Responses = http.app[RESPONSES]
    stored = await _get(store, owner, previous, "previous_response_id")
    rest = {k: v for k, v in body.items() if k != "previous_response_id"}
    return {**rest, "input": stored.continued() + as_items(body.get("input"))}


async def remember(
    app: web.Application, owner: str, body: dict, answer: dict | None, previous: str | None
) -> None:
    """Store a relayed answer for the turns that continue it (unless `store` is false)."""
    if answer is None or body.get("store") is False or not isinstance(answer.get("id"), str):
        return
    if previous is not None:
        answer["previous_response_id"] = previous
    try:
        await app[RESPONSES].put(answer["id"], Stored(owner, answer, as_items(body.get("input"))))
    except StoreUnavailable:
        log.warning(
            "response %s was answered but not stored: the store is unreachable", answer["id"]
        )


def restore_previous(response: web.StreamResponse, previous: str | None) -> None:
    """A whole answer says which response it continued, as the client asked (the worker was
    sent the conversation whole, and answered that it continued none)."""
    if previous is None or not isinstance(response, web.Response) or response.status >= 400:
        return
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        answer = orjson.loads(response.body)  # type: ignore[arg-type]
        answer["previous_response_id"] = previous
        response.body = orjson.dumps(answer)


def queued(rid: str, body: dict, previous: str | None) -> dict:
    """A background response's answer before it has begun."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued",
        "background": True,
        "model": body.get("model"),
        "instructions": body.get("instructions"),
        "previous_response_id": previous,
        "output": [],
        "usage": None,
    }


async def start_background(
    http: web.Request, owner: str, rid: str, body: dict, previous: str | None, run
) -> web.Response:
    """Answer `queued` now and generate in the background: `run()` returns the finished answer
    (or None); it is stored when done, `cancelled` when cancelled first."""
    app = http.app
    store: Responses = app[RESPONSES]
    first = queued(rid, body, previous)
    try:
        await store.hold(rid, HOLD)  # first: stored unheld, another reader would fail it
        await store.put(rid, Stored(owner, first, as_items(body.get("input"))))
    except StoreUnavailable:
        raise _store_down() from None
    await _listening(app)

    async def generate() -> None:
        answer, status = None, "failed"
        holding = asyncio.create_task(_renew(store, rid), name=f"fairway-hold-{rid}")
        try:
            answer = await run()
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            holding.cancel()
            app[BACKGROUND].pop(rid, None)
            final = answer or {**first, "status": status}
            final["background"] = True
            with contextlib.suppress(Exception):
                await remember(app, owner, body, final, previous)

    task = asyncio.create_task(generate(), name=f"fairway-response-{rid}")
    app[BACKGROUND][rid] = (owner, task)
    return web.json_response(first)


async def _renew(store: Responses, rid: str) -> None:
    """Keep holding `rid` while it generates here (until cancelled). A renewal the store does
    not answer is tried again at the next; the hold outlasts two such."""
    while True:
        await asyncio.sleep(RENEW_EVERY)
        try:
            await store.hold(rid, HOLD)
        except StoreUnavailable as e:
            log.warning("background response %s: hold not renewed (%s)", rid, e)


async def _read(app: web.Application, owner: str, rid: str) -> Stored:
    """The stored response; one generating that no router holds any more (its router died)
    is stored as failed first."""
    store: Responses = app[RESPONSES]
    stored = await _get(store, owner, rid)
    if stored.response.get("status") not in GENERATING or rid in app[BACKGROUND]:
        return stored
    try:
        if await store.is_held(rid):
            return stored
        error = {
            "code": "server_error",
            "message": "the router generating this response stopped before it ended",
        }
        failed = Stored(
            owner, {**stored.response, "status": "failed", "error": error}, stored.input
        )
        await store.put(rid, failed)
    except StoreUnavailable:
        raise _store_down() from None
    log.warning("background response %s: its router stopped; stored as failed", rid)
    return failed


async def retrieve(http: web.Request) -> web.Response:
    stored = await _read(http.app, owner_of(http), http.match_info["id"])
    return web.json_response(stored.response)


async def input_items(http: web.Request) -> web.Response:
    stored = await _get(http.app[RESPONSES], owner_of(http), http.match_info["id"])
    items = stored.input
    return web.json_response({"object": "list", "data": items, "has_more": False})


async def delete(http: web.Request) -> web.Response:
    rid = http.match_info["id"]
    try:
        deleted = await http.app[RESPONSES].delete(owner_of(http), rid)
    except StoreUnavailable:
        raise _store_down() from None
    if not deleted:
        raise _not_found(rid, http.app[RESPONSES].retention, "response_id")
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def cancel(http: web.Request) -> web.Response:
    """Stop a background response still generating: its task is cancelled, which closes the
    connection to its worker (vLLM aborts the request). Generating at another replica, that
    replica is asked to (through the store they share) and its answer read back."""
    app, rid, owner = http.app, http.match_info["id"], owner_of(http)
    running = app[BACKGROUND].get(rid)
    if running is not None and running[0] == owner:
        return web.json_response(await _stop(app, owner, rid, running[1]))
    stored = await _read(app, owner, rid)
    status = stored.response.get("status")
    if not stored.response.get("background"):
        raise bad_request("Cannot cancel a synchronous response.", "response_id")
    if status not in GENERATING:
        raise bad_request(f"Cannot cancel a response that has ended ({status}).", "response_id")
    try:
        heard = await app[RESPONSES].request_cancel(owner, rid)
    except StoreUnavailable:
        raise _store_down() from None
    deadline = time.monotonic() + CANCEL_WAIT
    while heard and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        stored = await _get(app[RESPONSES], owner, rid)
        if stored.response.get("status") not in GENERATING:
            return web.json_response(stored.response)
    why = f"did not stop it within {CANCEL_WAIT:g} s" if heard else "no replica heard the stop"
    raise APIError(
        409, f"response {rid} is generating at another router replica: {why}", param="response_id"
    )


async def _stop(app: web.Application, owner: str, rid: str, task: asyncio.Task) -> dict:
    """Cancel a background response generating here, and store it as cancelled."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    stored = await _get(app[RESPONSES], owner, rid)
    cancelled = {**stored.response, "status": "cancelled"}
    with contextlib.suppress(StoreUnavailable):
        await app[RESPONSES].put(rid, Stored(owner, cancelled, stored.input))
    return cancelled


async def _listening(app: web.Application) -> None:
    """Make sure this router hears the stops other replicas ask for (from its first
    background response on), waiting a little for it to start listening."""
    listener = app[CANCELS]
    if not listener:

        async def on_cancel(owner: str, rid: str) -> None:
            running = app[BACKGROUND].get(rid)
            if running is not None and running[0] == owner:
                with contextlib.suppress(APIError):  # expired meanwhile: nothing to mark
                    await _stop(app, owner, rid, running[1])

        listener["ready"] = ready = asyncio.Event()
        listen = app[RESPONSES].listen_for_cancels(on_cancel, ready)
        listener["task"] = asyncio.create_task(listen, name="fairway-cancel-listener")
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(listener["ready"].wait(), LISTEN_WAIT)


async def cancel_all(app: web.Application) -> None:
    """On the way out: background responses still generating are cancelled (and stored so),
    and this router stops listening for stops."""
    tasks = [task for _, task in app[BACKGROUND].values()]
    if app[CANCELS]:
        tasks.append(app[CANCELS]["task"])
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def install(app: web.Application) -> None:
    app[BACKGROUND] = {}
    app[CANCELS] = {}
    app.on_shutdown.append(cancel_all)
    app.router.add_get("/v1/responses/{id}", _answering(retrieve))
    app.router.add_get("/v1/responses/{id}/input_items", _answering(input_items))
    app.router.add_delete("/v1/responses/{id}", _answering(delete))
    app.router.add_post("/v1/responses/{id}/cancel", _answering(cancel))


def _answering(handler):
    async def wrapped(http: web.Request) -> web.StreamResponse:
        try:
            return await handler(http)
        except APIError as e:
            return e.response()

    return wrapped


async def _get(store: Responses, owner: str, rid: str, param: str = "response_id") -> Stored:
    if len(rid) > MAX_ID:  # no id this router made is so long: no store round trip
        raise _not_found(rid, store.retention, param)
    try:
        stored = await store.get(owner, rid)
    except StoreUnavailable:
        raise _store_down() from None
    if stored is None:
        raise _not_found(rid, store.retention, param)
    return stored


def _not_found(rid: str, retention: float, param: str) -> APIError:
    return APIError(
        404,
        f"Response with id '{rid[:64]}' not found: this router keeps a response for "
        f"{retention:g} s after it is made",
        "invalid_request_error",
        param,
        "response_not_found",
    )


def _store_down() -> APIError:
    error = APIError(
        503,
        "the conversation store is unreachable: a turn that continues a stored response cannot "
        "be served now (send the whole input instead, or retry)",
        "service_unavailable",
        code="store_unavailable",
    )
    error.headers["Retry-After"] = "1"
    return error
