"""The HTTP app (starlette): routes, error shapes, and the token source (sampling or script).

Why starlette + uvicorn: small, async, streams responses chunk by chunk, serves TLS. Generation
runs in worker threads (see ``completion.iterate_in_thread``), so the event loop keeps serving
other requests and streams while the model works.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..terminal import shown
from . import chat, messages, responses
from .common import check_model, continue_and_generate
from .completion import iterate_in_thread
from .engine import Engine, Finish, SamplingParams, TokenStep
from .errors import (ApiError, BadRequest, BodyParseError, PydanticError, ResponseNotFound, UnsupportedMediaType,
                     VllmError, field_error, missing)
from .fields import INT64_MAX, flag, list_of, to_int
from .parse import random_id
from .prompt import encode_prompt, normalize_tool, render, template_kwargs
from .script import Script, turn_token_ids
from .sse import WireJSONResponse as JSONResponse
from .sse import sse_data, sse_event

log = logging.getLogger("polar_train.server")
#: the vLLM release whose wire this server speaks (``/version``)
VLLM_VERSION = "0.32.0"


class Server:
    """What every route needs: the engine, the served name, the optional script."""

    def __init__(self, engine: Engine, served_name: str, script: Script | None = None,
                 chunk_delay_ms: float = 0.0) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_name = served_name
        self.script = script
        self.delay_s = chunk_delay_ms / 1000.0
        self.created = int(time.time())

    def plan(self, req: dict[str, Any]) -> None:
        """Resolve a scripted answer before any byte is sent (so a mismatch is a clean 400)."""
        if self.script is None:
            return
        view = req["view"]
        turn = self.script.turn_for(view)
        # answered as scripted (a model may call a tool it was not offered too), but said: a
        # scenario written for one harness's tool names gets refused calls from another's
        unoffered = sorted({c["name"] for c in turn.tool_calls} - set(view.tool_names))
        if unoffered:  # (a client's tool names: shown escaped and cut, never raw into the log)
            log.warning("scripted turn calls %s, which this %s request does not offer (its tools: %s)",
                        ", ".join(map(repr, unoffered)), view.api, ", ".join(map(shown, view.tool_names)) or "none")
        req["scripted_ids"] = turn_token_ids(self.tokenizer, turn)

    def tokens(self, req: dict[str, Any],
               params: SamplingParams | None = None) -> AsyncIterator[TokenStep]:
        """The request's tokens; ``params``: one choice's own (``n > 1``), else the request's."""
        prompt_ids, params = req["prompt_ids"], params or req["params"]
        if "scripted_ids" not in req:
            return iterate_in_thread(lambda cancelled: self.engine.generate(prompt_ids, params, cancelled),
                                     self.delay_s)
        ids = req["scripted_ids"]
        cut = ids[: params.max_tokens]

        def scripted(cancelled):
            steps = self.engine.score(prompt_ids, cut, params.top_logprobs)
            steps[-1].finish = Finish("stop") if len(cut) == len(ids) else Finish("length")
            yield from steps

        return iterate_in_thread(scripted, self.delay_s)


async def _json_body(request: Request) -> dict[str, Any]:
    """The body as FastAPI hands it to vLLM's request model; what it refuses is pydantic's error.
    A body that is not declared JSON is refused first, as vLLM's ``validate_json_request``."""
    if request.headers.get("content-type", "").lower().split(";", 1)[0] != "application/json":
        raise UnsupportedMediaType()
    raw = await request.body()
    if not raw:
        raise PydanticError([missing("body", None)])
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PydanticError([field_error("json_invalid", f"body.{exc.pos}", "JSON decode error", {},
                                         {"error": exc.msg})]) from None
    except (RecursionError, ValueError):  # nested past Python's limit, or no UTF-8: FastAPI's generic answer
        raise BodyParseError() from None
    if not isinstance(body, dict):
        raise PydanticError([field_error("model_attributes_type", "body", "Input should be a valid "
                                         "dictionary or object to extract fields from", body)])
    return body


#: What a field of an unexpected shape raises when it slips past the explicit checks.
_MALFORMED = (TypeError, AttributeError, ValueError, KeyError, IndexError, OverflowError, RecursionError)


def _guarded(prepare: Callable[..., Any], *args: Any) -> Any:
    """Run request preparation so that no malformed field can become a 500: what slips past the
    explicit checks is answered as vLLM's fallback answers ValueError/TypeError (400, its text)."""
    try:
        return prepare(*args)
    except _MALFORMED as exc:
        raise VllmError(str(exc)) from None


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` but cancel it when the client goes away (as vLLM aborts the request), then
    return None: the cancelled token iterator stops its worker thread, so the model is not kept
    busy for no one."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself was cancelled: the server stops
        raise ShuttingDown() from None  # (its answer, as vLLM's: uvicorn's own was a text/plain 500)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watch.cancelled() or not watch.done():  # (cancelled in between: the server stops)
            raise ShuttingDown() from None
        return None


class ShuttingDown(ApiError):
    """A request still generating when the server stopped (the grace after Ctrl-C or SIGTERM ran
    out, or a second Ctrl-C): answered in vLLM's error shape, a 500, as vLLM aborts it."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: the request was aborted before it finished")
        self.status, self.type = 500, "InternalServerError"


def _error(exc: Exception, anthropic: bool = False) -> Response:
    if isinstance(exc, ClientDisconnect):  # gone while it sent its body: no one to answer, nothing went wrong
        return Response(status_code=499)  # (it was logged as an internal error with a traceback, per client)
    if not isinstance(exc, ApiError):
        log.exception("internal error")
        exc = ApiError(f"internal server error: {type(exc).__name__}: {exc}")
        exc.status, exc.type = 500, "InternalServerError"
    body = exc.anthropic_body() if anthropic else exc.openai_body()
    inner = body.get("error") if isinstance(body.get("error"), dict) else body
    for key in ("message", "detail"):
        if isinstance(inner.get(key), str):
            inner[key] = sanitized(inner[key])
    return JSONResponse(body, status_code=exc.status)


def sanitized(message: str) -> str:
    """vLLM's ``sanitize_message``, applied to every error it answers: memory addresses, traceback
    lines and file paths out (a model named by its path came back whole: a probe)."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def _sse(gen: AsyncIterator[bytes], module=None) -> StreamingResponse:
    return StreamingResponse(_said_if_failed(gen, module) if module is not None else gen,
                             media_type="text/event-stream")  # (no cache-control: vLLM sends none)


async def _said_if_failed(gen: AsyncIterator[bytes], module) -> AsyncIterator[bytes]:
    """An error once a stream has begun, as vLLM ends such a stream: logged with its traceback,
    then chat's ``data: {"error": ...}`` and ``[DONE]``, or Messages' ``error`` event (the
    Responses API's stream just ends, as vLLM's). It was cut without a word, and nothing logged."""
    try:
        async for piece in gen:
            yield piece
    except asyncio.CancelledError:  # the server stops (the grace ran out): told as vLLM tells it, the
        for piece in _stream_error(module, str(ShuttingDown())):  # body then ended (it was cut mid-chunk)
            yield piece
    except Exception as exc:  # noqa: BLE001 - whatever failed, the client is told rather than cut off
        log.exception("error in a streamed answer")
        for piece in _stream_error(module, str(exc)):
            yield piece


def _stream_error(module, message: str) -> list[bytes]:
    """How vLLM ends a stream on an error: chat's error data and ``[DONE]``, Messages' ``error``
    event, nothing for the Responses API (its stream just ends)."""
    if module is messages:
        return [sse_event("error", {"type": "error", "error": {"type": "internal_error", "message": message}})]
    if module is chat:
        return [sse_data({"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}),
                b"data: [DONE]\n\n"]
    return []


def _base_request_id(request: Request, body: dict[str, Any]) -> str:
    """vLLM's ``_base_request_id``: the ``X-Request-Id`` header, else the body's ``request_id``, else
    a random one (a client that matches its calls by request id found none of its own here)."""
    given = request.headers.get("x-request-id")
    if given is None and isinstance(body.get("request_id"), str):
        given = body["request_id"]
    return random_id() if given is None else given


def token_ids(items: list) -> list[int]:
    """``/detokenize``'s ``tokens`` as vLLM's pydantic model reads them: lax integers (``true`` is 1,
    ``2.0`` and ``"3"`` are ids) from 0 to 2**63-1, every failing item named (``body.tokens.N``);
    an id past the vocabulary decodes to nothing, as in vLLM."""
    ids, errors = [], []
    for n, item in enumerate(items):
        try:
            value = to_int(item, f"tokens.{n}")
        except PydanticError as exc:
            errors += exc.errors
            continue
        if value < 0:
            errors.append(field_error("greater_than_equal", f"body.tokens.{n}", "Input should be greater than or "
                                      "equal to 0", item, {"ge": 0}))
        elif value > INT64_MAX:
            errors.append(field_error("less_than_equal", f"body.tokens.{n}", "Input should be less than or equal "
                                      f"to {INT64_MAX}", item, {"le": INT64_MAX}))
        ids.append(value)
    if errors:
        raise PydanticError(errors)
    return ids


def build_app(server: Server) -> Starlette:
    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": server.served_name, "object": "model", "created": server.created,
            "owned_by": "vllm", "root": str(server.engine.model_dir), "parent": None,
            "max_model_len": server.engine.max_model_len,
            "permission": [{
                "id": "modelperm-polar", "object": "model_permission", "created": server.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }]})

    def _prepare(module, body: dict[str, Any]) -> dict[str, Any]:
        req = module.prepare(server, body)
        server.plan(req)
        return req

    def api(module, anthropic: bool = False):
        async def handler(request: Request) -> Response:
            try:
                body = await _json_body(request)
                # rendering a 20k-token prompt takes a while: off the event loop, like generation
                req = await asyncio.to_thread(_guarded, _prepare, module, body)
                if module is chat or module is messages:
                    req["id"] = f"chatcmpl-{_base_request_id(request, body if module is chat else {})}"
                if req["stream"]:
                    return _sse(module.stream(server, req), module)
                result = await _unless_disconnected(request, module.respond(server, req))
                if result is None:
                    return Response(status_code=499)  # the client is gone; nobody reads this
                return JSONResponse(result)
            except Exception as exc:  # noqa: BLE001 - every error becomes the API's error shape
                return _error(exc, anthropic)
        return handler

    async def count_tokens(request: Request) -> Response:
        try:
            body = await _json_body(request)
            req = _guarded(messages.prepare, server, body, True)
            n = len(req["prompt_ids"])
            return JSONResponse({"input_tokens": n, "context_management": {"original_input_tokens": n}})
        except Exception as exc:  # noqa: BLE001
            return _error(exc, anthropic=True)

    def _tokenize_ids(body: dict[str, Any]) -> list[int]:
        check_model(body, server.served_name)
        if isinstance(body.get("messages"), list):
            if flag(body, "continue_final_message") and flag(body, "add_generation_prompt", True):
                raise continue_and_generate()
            tools = [normalize_tool(t) for t in body.get("tools") or []]
            text = render(server.tokenizer, body["messages"], tools or None,
                          add_generation_prompt=flag(body, "add_generation_prompt", True),
                          continue_final_message=flag(body, "continue_final_message"),
                          kwargs=template_kwargs(body.get("chat_template_kwargs"), None))
            # (no character bound: vLLM's /tokenize counts a text of any length - one too long to
            # serve is what a client measures with it; a probe)
            return list(server.engine.tokenizer.encode(text, add_special_tokens=False))
        if isinstance(body.get("prompt"), str):
            return list(server.engine.tokenizer.encode(body["prompt"],
                                                       add_special_tokens=flag(body, "add_special_tokens", True)))
        # vLLM's union of a prompt and a messages request: both branches are reported
        prompt = [missing("body.prompt", body)] if "prompt" not in body else [field_error(
            "string_type", "body.prompt", "Input should be a valid string", body["prompt"])]
        chat = [missing("body.messages", body)] if "messages" not in body else [field_error(
            "list_type", "body.messages", "Input should be a valid list", body["messages"])]
        raise PydanticError(prompt + chat)

    async def tokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            ids = _guarded(_tokenize_ids, body)
            strs = server.tokenizer.convert_ids_to_tokens(ids) if flag(body, "return_token_strs") else None
            return JSONResponse({"count": len(ids), "max_model_len": server.engine.max_model_len,
                                 "tokens": ids, "token_strs": strs})
        except Exception as exc:  # noqa: BLE001
            return _error(exc)

    async def detokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            check_model(body, server.served_name)
            ids = token_ids(list_of(body, "tokens", need=True))
            try:
                text = server.tokenizer.decode(ids, skip_special_tokens=False)
            except OverflowError as exc:  # an id past 32 bits: the tokenizer's own words, as vLLM's
                raise VllmError(str(exc).splitlines()[0]) from None
            return JSONResponse({"prompt": text})
        except Exception as exc:  # noqa: BLE001
            return _error(exc)

    async def stored_response(request: Request) -> Response:
        """``GET /v1/responses/{id}`` and ``POST .../cancel``: nothing is stored (vLLM without
        ``VLLM_ENABLE_RESPONSES_API_STORE``), so every id is vLLM's 404 (the SDK's
        ``responses.retrieve`` read a bare ``{"detail": "Not Found"}`` as "Error code: 404")."""
        return _error(ResponseNotFound(f"Response with id '{request.path_params['response_id']}' not found.",
                                       param="response_id"))

    async def version(_: Request) -> JSONResponse:
        return JSONResponse({"version": VLLM_VERSION})

    async def load(_: Request) -> JSONResponse:
        return JSONResponse({"server_load": 0})  # vLLM without --enable-server-load-tracking

    routes = [
        _get_only(Route("/health", health, methods=["GET"])),
        _get_only(Route("/v1/models", models, methods=["GET"])),
        _get_only(Route("/version", version, methods=["GET"])),
        _get_only(Route("/load", load, methods=["GET"])),
        _get_only(Route("/ping", health, methods=["GET", "POST"])),
        Route("/v1/chat/completions", api(chat), methods=["POST"]),
        Route("/v1/responses", api(responses), methods=["POST"]),
        _get_only(Route("/v1/responses/{response_id}", stored_response, methods=["GET"])),
        Route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"]),
        Route("/v1/messages", api(messages, anthropic=True), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _route_error})


def _get_only(route: Route) -> Route:
    """A GET route without the HEAD starlette adds: vLLM's FastAPI answers HEAD with a 405
    (``allow: GET``)."""
    route.methods.discard("HEAD")
    return route


async def _route_error(request: Request, exc: HTTPException) -> Response:
    """An unknown path or method, shaped as vLLM's FastAPI answers it: ``{"detail": "Not Found"}``
    as JSON (starlette alone answers plain text), the ``allow`` header kept on a 405."""
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
