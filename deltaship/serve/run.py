"""Starting the server: the engine on an opened bundle, the app, uvicorn; in this thread (`deltaship serve`) or in
a background one (`ServerThread`: tests, benches, an app embedding it)."""

from __future__ import annotations

import ipaddress
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Session
from deltaship.serve.app import Served, build_app
from deltaship.serve.engine import Engine, Scheduler
from deltaship.targets import open_bundle

GIB = 1 << 30


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_sessions: int = 64  # conversations held (LRU)
    cache_ram: float = 2.0  # GiB the held conversations may take (LRU)
    max_queue: int = 64  # requests waiting or running; past it a 503 with Retry-After
    reuse: bool = True  # False: every request prefills its whole prompt (the bench's baseline)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise DeltashipError(f"--port {self.port} is not a TCP port", "pass 1..65535 (0: any free port)")
        if self.max_sessions < 1 or self.max_queue < 1:
            raise DeltashipError("--max-sessions and --max-queue must be 1 or more", "e.g. --max-sessions 64")
        if not 0 <= self.cache_ram < 1 << 20:
            raise DeltashipError(f"--cache-ram {self.cache_ram} GiB is out of range", "pass e.g. --cache-ram 2")
        if self.api_key is not None and not self.api_key.strip():
            raise DeltashipError("--api-key is empty", "pass a key, or leave --api-key out on loopback")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to tell the user when the server listens beyond this machine without a key."""
    if api_key is not None or _is_loopback(host):
        return None
    return (
        f"deltaship serve: listening on {host}, beyond this machine, without --api-key: anyone who can reach it "
        "can use the model; pass --api-key KEY, or --host 127.0.0.1"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_app(session: Session, opts: ServeOptions, tokenizer: Any = None, template: str | None = None):
    """The app and what it serves, on an open session (tokenizer, template: for a bundle that carries none)."""
    engine = Engine(session, int(opts.cache_ram * GIB), opts.max_sessions, opts.reuse, tokenizer, template)
    source = session.manifest.get("source", {})
    model = str(source.get("model") or Path(session.bundle).name)
    served = Served(engine, Scheduler(opts.max_queue), model, opts.api_key)
    return build_app(served), served


def _uvicorn(app, opts: ServeOptions):
    import uvicorn  # lazy: uvicorn: the serve extra's HTTP server

    config = uvicorn.Config(
        app, host=opts.host, port=opts.port, log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )
    return uvicorn.Server(config)


def serve_forever(bundle: str | Path, opts: ServeOptions, threads: int | None = None) -> int:
    """Serve until interrupted (Ctrl-C, SIGTERM: uvicorn finishes the requests in flight first)."""
    warning = exposure_warning(opts.host, opts.api_key)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    app, served = make_app(open_bundle(bundle, threads=threads), opts)
    server = _uvicorn(app, opts)
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    print(
        f"deltaship serve: {served.model} on http://{host}:{opts.port}/v1 (Ctrl-C stops it)",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run()
    finally:
        served.scheduler.close()
    return 0


class ServerThread:
    """A server in a background thread: `with ServerThread(session, ServeOptions(port=0)) as s: s.url`."""

    def __init__(self, session: Session, opts: ServeOptions, tokenizer: Any = None, template: str | None = None):
        self.app, self.served = make_app(session, opts, tokenizer, template)
        self.server = _uvicorn(self.app, opts)
        self._thread = threading.Thread(target=self.server.run, name="deltaship-serve", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise DeltashipError("deltaship serve: the server did not start", "check that the port is free")
            time.sleep(0.02)
        return self

    @property
    def address(self) -> tuple[str, int]:
        """The address the server's socket is bound to."""
        return self.server.servers[0].sockets[0].getsockname()[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self.served.scheduler.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
