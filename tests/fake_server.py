"""Both front ends of the real server (``OpenAIServer`` under uvicorn, ``GrpcServer``) over ``AsyncEngine`` and the
stand-in ``FakeEngine``, in a background thread of this process on free loopback ports: for tests whose point is
the server (fuzzing, soaks, error paths), which then need no model and no compiles."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import uvicorn

from fake_engine import FakeEngine
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.config.engine import EngineConfig
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.grpc_api import GrpcServer
from jaxserve.server.limits import RequestLimits
from jaxserve.server.openai.server import OpenAIServer

MODEL = "fake"


class FakeServer:
    """``http`` (base URL), ``grpc`` (host:port), ``engine`` (the AsyncEngine), ``fake`` (the FakeEngine)."""

    def __init__(self, *, limits: RequestLimits | None = None, options: dict | None = None, **config):
        """``options``: the front ends' own (``api_key``, ``prompt_tokens_details``, ``cache_salt_per_api_key``;
        ``admin`` and ``response_role`` go to HTTP only)."""
        self.config = EngineConfig(warmup=False, **config)
        self.limits = limits
        self.options = dict(options or {})
        self.fake: FakeEngine | None = None
        self.engine: AsyncEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="fake-server", daemon=True)

    def _factory(self, cfg):
        self.fake = FakeEngine(cfg)
        self.fake.check_lengths = True  # as the real engine: no request outlives max_model_len
        return self.fake

    async def _main(self) -> None:
        try:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            metrics = ServerMetrics(MODEL)
            self.engine = AsyncEngine(self.config, metrics=metrics, engine_factory=self._factory)
            metrics.attach_engine(self.engine.stats, self.engine.intake_length)
            grpc_options = {k: v for k, v in self.options.items() if k not in ("admin", "response_role")}
            grpc_server = GrpcServer(self.engine, metrics, [MODEL], limits=self.limits, **grpc_options)
            grpc_port = grpc_server.bind("127.0.0.1", 0)
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(256)
            app = OpenAIServer(self.engine, metrics, [MODEL], limits=self.limits, **self.options).app()
            http = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                                 timeout_keep_alive=5))
            http.install_signal_handlers = lambda: None
            http.capture_signals = contextlib.nullcontext
            self.engine.start()
            await self.engine.wait_ready()
            await grpc_server.start()
            await grpc_server.set_serving(True)
            task = asyncio.create_task(http.serve(sockets=[sock]))
            while not http.started:
                await asyncio.sleep(0.01)
            self.http = f"http://127.0.0.1:{sock.getsockname()[1]}"
            self.grpc = f"127.0.0.1:{grpc_port}"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self._error = e
            self._started.set()
            raise
        self._started.set()
        await self._stop.wait()
        self.engine.abort_all()
        await self.engine.wait_idle(10)
        await grpc_server.stop(1)
        http.should_exit = True
        await task
        await self.engine.stop()

    def __enter__(self) -> FakeServer:
        self._thread.start()
        self._started.wait(60)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def run(self, coro, timeout: float = 30):
        """Run a coroutine on the server's event loop (e.g. to read ``engine`` state) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.num_live_requests == 0 and self.fake.pages_used == 0 and not self.fake.requests:
                return True
            time.sleep(0.02)
        return False
