"""The HTTP port: OpenAI-compatible API, vLLM's `/tokenize` `/detokenize` `/version`,
`/openapi.json`, `/metrics` (Prometheus) and `/health`."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import ssl
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from bucketserve.gateway.access_log import GENERATION, TENANT, AccessLog
from bucketserve.gateway.admission import Admission
from bucketserve.gateway.errors import (
    BucketServeError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from bucketserve.gateway.gateway_config import BindError, GatewayConfig
from bucketserve.gateway.metrics import GatewayMetrics
from bucketserve.gateway.openai.api import OpenAIApi, package_version
from bucketserve.gateway.openai.schema import openapi_document
from bucketserve.gateway.openai.serving import error_body
from bucketserve.gateway.tenant_registry import parse_bearer

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpServer:
    def __init__(
        self,
        config: GatewayConfig,
        admission: Admission,
        metrics: GatewayMetrics,
        model_name: str,
    ) -> None:
        self.config = config
        self.admission = admission
        self.metrics = metrics
        self.access_log = AccessLog(config.log_prompts)
        self.app = web.Application(
            middlewares=[self._access, _openai_errors],
            client_max_size=config.max_message_bytes,
        )
        self.app.add_routes(OpenAIApi(admission, model_name, config).routes())
        self.app.add_routes([
            web.get("/metrics", self.scrape),
            web.get("/health", self.health),
            web.get("/openapi.json", self.openapi),
        ])
        self.schema = openapi_document(f"bucketserve ({model_name})", package_version())
        # a client that disconnects cancels its handler, which aborts its request
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self.port: int | None = None

    async def start(self) -> int:
        await self.runner.setup()
        site = web.TCPSite(
            self.runner, self.config.host, self.config.http_port, ssl_context=self._ssl()
        )
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            where = f"{self.config.host}:{self.config.http_port}"
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise BindError(
                f"cannot bind HTTP to {where}: {reason}. "
                "Choose another port with gateway.http_port or --http-port"
            ) from None
        self.port = int(self.runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def scrape(self, request: web.Request) -> web.Response:
        """Prometheus text; with gateway.metrics_auth, only for a tenant's key (it names the
        tenants and their usage)."""
        if self.config.metrics_auth:
            api_key = parse_bearer(request.headers.get("Authorization"))
            request[TENANT] = self.admission.tenant(api_key).name
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self.schema)

    async def health(self, request: web.Request) -> web.Response:
        serving = not self.admission.draining and self.admission.backend.serving()
        return web.Response(status=200 if serving else 503)

    @web.middleware
    async def _access(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """One access-log line per request, however it ended."""
        started, status = time.monotonic(), 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            route = f"{request.method} {request.path}"
            tenant, gen = request.get(TENANT), request.get(GENERATION)
            self.access_log.record(route, status, started, tenant, gen)

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.config.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.config.tls_cert_file), str(self.config.tls_key_file))
        return context


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as OpenAI's error JSON with the matching status (and Retry-After)."""
    try:
        return await handler(request)
    except BucketServeError as exc:
        error = exc
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _http_error(exc, request)
    except ConnectionResetError:
        raise
    except Exception:
        logger.exception("bug while handling %s %s", request.method, request.path)
        error = InternalError("the server hit a bug; see its log")
    headers = {}
    if isinstance(error, ResourceExhaustedError):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return web.json_response(error_body(error), status=error.http_status, headers=headers)


def _http_error(exc: web.HTTPException, request: web.Request) -> BucketServeError:
    if exc.status == 404:
        return NotFoundError(f"no route {request.path}; see /v1/models, /v1/completions, ...")
    error = InvalidArgumentError(f"{request.method} {request.path}: {exc.reason}")
    error.http_status = exc.status
    return error
