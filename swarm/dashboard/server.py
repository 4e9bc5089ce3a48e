"""Serve an ASGI app (the dashboard, metrics) with uvicorn on a background thread, off the serving path.

The socket is bound here first, so a port of 0 is resolved before the server starts and the caller learns the URL at
once; ``close`` asks uvicorn to exit and joins its thread. Its connections are guarded (``swarm.dashboard.guard``):
idle and slow ones are cut, and a flood of them cuts only itself."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from starlette.types import ASGIApp

from swarm.dashboard.access import Access
from swarm.dashboard.guard import ConnectionLimits, Guard
from swarm.errors import BadInputError

GRACEFUL_SECONDS = 1.0  # open streams (the dashboard's live events) are cut after this at shutdown


class ThreadedServer:
    def __init__(self, app: ASGIApp, host: str, port: int, name: str = "http", guard: Guard | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except OSError as e:
            self._sock.close()
            raise BadInputError(f"the {name} server cannot listen on {host}:{port}: {e.strerror or e}") from None
        except BaseException:
            self._sock.close()
            raise
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self.guard = guard or Guard(ConnectionLimits(), Access())
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=int(GRACEFUL_SECONDS) or 1,
            http=self.guard.protocol(),
            ws="none",
            timeout_keep_alive=int(self.guard.limits.keep_alive_timeout) or 1,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=f"{name}-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.server.run(sockets=[self._sock])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def wait_started(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            if self.server.started:
                return True
            time.sleep(0.02)
        return bool(self.server.started)

    def close(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(1.0)
        self._sock.close()


def serve_in_thread(
    app: ASGIApp, host: str, port: int, name: str = "http", guard: Guard | None = None
) -> ThreadedServer:
    """Start serving ``app`` on ``host:port`` (0: any free port); ``.url`` says where, ``.close()`` stops it.
    ``guard``: its connections' limits and keys (default: the default limits, no keys)."""
    server = ThreadedServer(app, host, port, name, guard)
    if not server.wait_started():
        server.close()
        raise RuntimeError(f"the {name} server on {host}:{port} did not start")
    return server
