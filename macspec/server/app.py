"""The HTTP side of `macspec serve`: an ASGI app (Starlette) with OpenAI's endpoints.

Requests are checked on the event loop (JSON, fields, the prompt's ids and length) and answered
at once when bad; good ones become jobs of the Scheduler, whose rounds come back one by one:
streamed as server-sent events, one per round, or joined into one answer. A client that goes away
cancels its job at the next round."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import chat_template, grammar, tool_calls
from ..api import stream as api
from ..api.pair import Pair
from . import logprobs, protocol
from .protocol import DONE, HTTPError, Request, chunk, error_body, sse
from .scheduler import END, Job, PromptRead, Scheduler

MAX_BODY = 4 << 20  # bytes of request body; a 128K-token conversation is about 0.5 MB
POLL = 0.25  # seconds between checks that a waiting client is still there


class ClientGone(Exception):
    """The client disconnected while its answer was being made."""


def create_app(
    pair: Pair,
    scheduler: Scheduler,
    *,
    api_key: str | None = None,
    defaults: dict[str, Any] | None = None,
    max_body: int = MAX_BODY,
) -> Starlette:
    """The app serving `pair` through `scheduler` (started and stopped with the app)."""
    server = _Server(pair, scheduler, api_key, dict(defaults or {}), max_body)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await scheduler.start()
        try:
            yield
        finally:
            await scheduler.wait_closed()

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
    )


def error_response(e: BaseException) -> JSONResponse:
    status, body = error_body(e)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def _http_exception(request: HTTPRequest, e: HTTPException) -> Response:
    # Starlette's own: no such route (404), wrong method (405)
    return error_response(HTTPError(str(e.detail), e.status_code, code="not_found"))


async def _unexpected(request: HTTPRequest, e: Exception) -> Response:
    return error_response(e)


class _Server:
    def __init__(
        self,
        pair: Pair,
        scheduler: Scheduler,
        api_key: str | None,
        defaults: dict[str, Any],
        max_body: int,
    ) -> None:
        self.pair, self.scheduler, self.api_key = pair, scheduler, api_key
        self.defaults, self.max_body = defaults, max_body
        self.model_id = pair.target_path.name
        self.created = int(time.time())
        self._pieces: logprobs.Pieces | None = None

    def pieces(self) -> logprobs.Pieces:
        """Each id's bytes, for logprobs (llguidance's view of the tokenizer: exact bytes)."""
        if self._pieces is None:
            eos = sorted(self.pair.eos_token_ids)
            lltok = grammar.ll_tokenizer(self.pair.tokenizer, eos)
            self._pieces = logprobs.Pieces(lltok.decode_bytes)
        return self._pieces

    def _logprobs(self, req: Request, entries: list, offset: int = 0) -> dict | None:
        """A choice's `logprobs` in the endpoint's shape (None when not asked for)."""
        if req.logprobs is None:
            return None
        if req.endpoint == "chat":
            return logprobs.chat(entries, self.pieces(), req.logprobs)
        return logprobs.legacy(entries, self.pieces(), req.logprobs, offset)

    # -- endpoints

    async def health(self, request: HTTPRequest) -> Response:
        cache = self.pair.prompt_cache
        body = {
            "status": "ok",
            "model": self.model_id,
            "pair": self.pair.describe(),
            **self.scheduler.status(),
            "prompt_cache": None
            if cache is None
            else {"entries": len(cache), "bytes": cache.nbytes, "max_bytes": cache.max_bytes},
        }
        return JSONResponse(body)

    def _model_object(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "macspec",
        }

    async def models(self, request: HTTPRequest) -> Response:
        try:
            self._authorize(request)
        except HTTPError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: HTTPRequest) -> Response:
        try:
            self._authorize(request)
            self._check_model(request.path_params["model"])
        except HTTPError as e:
            return error_response(e)
        return JSONResponse(self._model_object())

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, "completion")

    # -- a completion

    async def _complete(self, request: HTTPRequest, endpoint: str) -> Response:
        try:
            self._authorize(request)
            data = protocol.parse_json(await self._body(request))
            req = protocol.parse_request(data, endpoint, self.defaults)
            if req.model is not None:
                self._check_model(req.model)
            ids, family = self._prompt(req)
            api.check_length(self.pair, ids)
        except Exception as e:
            return error_response(e)
        job = self.scheduler.submit(ids, req.options, progress=req.stream and req.progress)
        try:
            first = await self._next(job, request)
            if isinstance(first, BaseException):
                return error_response(first)
            if first is END:  # submitted while the server was stopping
                return error_response(
                    HTTPError("the server is shutting down", 503, kind="server_error")
                )
            if req.stream:
                events = self._events(job, req, len(ids), first, family)
                headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            return await self._whole(job, req, len(ids), first, request, family)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not req.stream:
                self.scheduler.cancel(job)  # no-op once it has finished

    def _prompt(self, req: Request) -> tuple[list[int], str | None]:
        """The prompt's ids, and the tool-call family to read from the answer (None: no tools).
        With tools, a template that takes none or writes calls macspec cannot read is a 400."""
        tokenizer, family = self.pair.tokenizer, None
        if req.messages is None:
            return api.prompt_ids(self.pair, req.prompt), None
        tools = req.tools if req.tool_choice.mode != "none" else None
        text = chat_template.render(tokenizer, req.messages, tools)
        if tools:
            family = tool_calls.family_of(tokenizer.chat_template)
            if family is None:
                raise HTTPError(
                    "this model's template takes tools, but writes calls in a format macspec "
                    f"does not read (it reads {', '.join(tool_calls.FAMILIES)})",
                    param="tools",
                )
        if req.tool_choice.mode == "required":
            specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
            template, parallel = tokenizer.chat_template, req.parallel_tool_calls
            spec = tool_calls.required_spec(
                template, req.tools, req.tool_choice, specials, parallel
            )
            req.options["grammar"] = spec.text
        return api.prompt_ids(self.pair, text), family

    async def _whole(
        self,
        job: Job,
        req: Request,
        prompt_tokens: int,
        item: Any,
        request: HTTPRequest,
        family: str | None,
    ) -> Response:
        parts, stats, reason, entries = [], None, None, []
        while item is not END:
            if isinstance(item, BaseException):
                return error_response(item)
            parts.append(item.text)
            entries += item.logprobs or ()
            stats, reason = item.stats, item.finish_reason or reason
            item = await self._next(job, request)
        text, calls = "".join(parts), []
        if family is not None:
            reader = tool_calls.ToolCallStream(family)
            head, _ = reader.feed(text)
            tail, _ = reader.finish()
            text, calls = head + tail, reader.calls
        rid = protocol.new_id(req.endpoint)
        use = protocol.usage(stats, prompt_tokens)
        end = protocol.finish_reason(reason)
        lps = self._logprobs(req, entries)
        body = protocol.answer(req, rid, self.model_id, text, end, use, calls, lps)
        return JSONResponse(body)

    async def _events(
        self, job: Job, req: Request, prompt_tokens: int, item: Any, family: str | None
    ):
        """The server-sent events of a streamed answer: one chunk per round (tool calls in the
        chunk of the round that completes them)."""
        rid, created, model = protocol.new_id(req.endpoint), int(time.time()), self.model_id
        stats, reason, entries, offset = None, None, [], 0
        reader = tool_calls.ToolCallStream(family) if family is not None else None
        try:
            if req.endpoint == "chat":
                yield chunk(req, rid, model, created, "")
            while item is not END:
                if isinstance(item, BaseException):
                    yield sse(error_body(item)[1])
                    yield DONE
                    return
                if isinstance(item, PromptRead):
                    told = protocol.prompt_progress(
                        item.processed, item.total, item.cached, item.seconds
                    )
                    yield chunk(req, rid, model, created, None, progress=told)
                    item = await job.events.get()
                    continue
                stats, reason = item.stats, item.finish_reason or reason
                text, calls = reader.feed(item.text) if reader else (item.text, [])
                entries += item.logprobs or ()  # held with text a tool-call reader holds back
                if text or calls:
                    live = {"drafted": item.num_draft, "accepted": len(item.accepted)}
                    numbered = _numbered(reader, calls)
                    lps = self._logprobs(req, entries, offset)
                    entries, offset = [], offset + len(text)
                    yield chunk(
                        req, rid, model, created, text, extra=live, calls=numbered, logprobs=lps
                    )
                item = await job.events.get()
            if reader is not None:
                text, calls = reader.finish()
                if text or calls:
                    numbered, lps = _numbered(reader, calls), self._logprobs(req, entries, offset)
                    yield chunk(req, rid, model, created, text, calls=numbered, logprobs=lps)
            end = protocol.finish_reason(None if job.stopped else reason)
            if reader is not None and reader.calls and end == "stop":
                end = "tool_calls"
            yield chunk(req, rid, model, created, None, end)
            if req.include_usage:
                yield chunk(
                    req, rid, model, created, None, use=protocol.usage(stats, prompt_tokens)
                )
            yield DONE
        finally:  # also when the client went away (the response task is cancelled)
            self.scheduler.cancel(job)

    async def _next(self, job: Job, request: HTTPRequest) -> Any:
        """The job's next item, watching meanwhile that its client is still there."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.scheduler.cancel(job)
                    raise ClientGone() from None

    # -- checks

    def _authorize(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise HTTPError(
                "a valid API key is required (Authorization: Bearer KEY)",
                401,
                code="invalid_api_key",
            )

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise HTTPError(
                f"the model {model!r} does not exist: this server serves {self.model_id!r}",
                404,
                param="model",
                code="model_not_found",
            )

    async def _body(self, request: HTTPRequest) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise HTTPError("invalid Content-Length", code="invalid_request")
            if int(declared) > self.max_body:
                raise _too_large(self.max_body)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body:
                raise _too_large(self.max_body)
        return bytes(body)


def _numbered(reader: Any, calls: list) -> list:
    """(index in the answer, call) for calls just completed: the last ones the reader holds."""
    first = len(reader.calls) - len(calls) if reader is not None else 0
    return list(enumerate(calls, first))


def _too_large(cap: int) -> HTTPError:
    return HTTPError(
        f"the request body is larger than this server takes ({cap} bytes)",
        413,
        code="request_too_large",
    )
