"""Running the sandbox: on a background thread for the demo and the tests (`SandboxServer`), or in
the foreground for `delivery sandbox` (`serve`). uvicorn serves the app; the socket is bound here."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace
from types import FrameType, TracebackType

import uvicorn

from delivery.errors import InputError
from playground.sandbox.app import SandboxApp, create_app
from playground.sandbox.settings import SandboxSettings
from playground.sandbox.store import UnusableDatabase

__all__ = ["SandboxServer", "serve"]

logger = logging.getLogger("playground.sandbox")


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, plus: Ctrl-C also releases requests hanging in an injected fault, which
    uvicorn's graceful shutdown would otherwise wait out."""

    def __init__(self, config: uvicorn.Config, app: SandboxApp) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.release_waits()
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, which calls `sys.exit` on a taken port: the caller gets an
    OSError naming the address, and port 0 is known before the server thread starts."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    # A wildcard address is where we listen, not where a client connects.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/api"


class SandboxServer:
    """The sandbox on a background thread, for the demo and the tests:

        with SandboxServer(SandboxSettings(port=0)) as server:
            httpx.post(f"{server.url}/contacts", json={...})

    Quiet (warnings only, no access log) and leaves the host process's logging configuration
    alone, because it runs inside someone else's process.
    """

    def __init__(self, settings: SandboxSettings) -> None:
        settings.validate()
        self.settings = replace(settings)
        self._app: SandboxApp | None = None
        self._server: _UvicornServer | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._port: int | None = None
        self._failure: BaseException | None = None

    def start(self) -> SandboxServer:
        """Return once the server accepts connections; raise if it could not start."""
        if self._thread is not None:
            return self
        app = create_app(self.settings)
        try:
            sock = _bind(self.settings.host, self.settings.port)
        except OSError:
            app.close()
            raise
        config = uvicorn.Config(
            app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="on",
            ws="none",
            timeout_graceful_shutdown=5,
        )
        server = _UvicornServer(config, app)
        self._app, self._server, self._socket, self._failure = app, server, sock, None
        self._port = int(sock.getsockname()[1])
        self._thread = threading.Thread(target=self._run, name=f"delivery-sandbox-{self._port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                failure = self._failure
                self.stop()
                raise RuntimeError(f"the sandbox did not start on {self.settings.host}:{self._port}") from failure
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        assert self._server is not None and self._socket is not None
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # uvicorn exits with SystemExit; keep it off the thread hook
            self._failure = exc
            logger.error("the sandbox server stopped with %r", exc)

    @property
    def port(self) -> int:
        if self._port is not None:
            return self._port
        if self.settings.port == 0:
            raise RuntimeError("the sandbox picks its port at start(); start it first")
        return self.settings.port

    @property
    def url(self) -> str:
        """The `base_url` a `rest` connection uses, e.g. `http://127.0.0.1:8900/api`."""
        return _url(self.settings.host, self.port)

    def stop(self) -> None:
        """Stop accepting, release hanging requests, finish in-flight ones, join the thread.
        Safe to call twice."""
        app, server, thread, sock = self._app, self._server, self._thread, self._socket
        if app is not None:
            app.release_waits()
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)
            if thread.is_alive() and server is not None:
                server.force_exit = True
                thread.join(timeout=5)
        if sock is not None:
            sock.close()
        if app is not None:
            app.close()
        self._app = self._server = self._thread = self._socket = None
        self._port = None

    def __enter__(self) -> SandboxServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve(settings: SandboxSettings) -> None:
    """Run in the foreground with uvicorn's logging and access log until Ctrl-C, which returns
    normally after a graceful shutdown (hanging requests are released first).

    A database file it cannot use or a port it cannot listen on is the operator's bad input to
    `delivery sandbox`: an InputError naming the flag, which the CLI shows as one line, exit 2."""
    try:
        app = create_app(settings)
    except UnusableDatabase as exc:
        raise InputError(f"--db {exc.path}: {exc.reason}") from exc
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        app.close()
        raise InputError(f"--port {settings.port}: {exc.strerror or exc}") from exc
    config = uvicorn.Config(app, log_level="info", lifespan="on", ws="none", timeout_graceful_shutdown=5)
    server = _UvicornServer(config, app)
    port = int(sock.getsockname()[1])
    logging.getLogger("uvicorn.error").info(
        "Sandbox target on %s (token %s, %s, records %s). Press Ctrl-C to stop.",
        _url(settings.host, port),
        "required" if settings.token else "not required",
        app.faults_in_words(),
        settings.db_path or "in memory",
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the captured SIGINT after shutting down; that is the normal exit
    finally:
        sock.close()
        app.close()
