"""`deltaship serve`: an OpenAI-compatible server on a bundle, holding conversations' states across requests
(docs/serve.md)."""

from __future__ import annotations

from pathlib import Path

from deltaship.errors import DeltashipEnvironmentError


def serve(
    bundle: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_sessions: int = 64,
    cache_ram: float = 2.0,
    max_queue: int = 64,
    no_reuse: bool = False,
    threads: int | None = None,
) -> int:
    """Serve the bundle until interrupted. max_sessions: conversations held; cache_ram: GiB they may take (both
    least-recently-used); max_queue: requests waiting or running before a 503; no_reuse: prefill every prompt whole."""
    try:
        # lazy: starlette, uvicorn and pydantic: the serve extra, imported only to serve
        from deltaship.serve.run import ServeOptions, serve_forever
    except ImportError as e:
        raise DeltashipEnvironmentError(
            f"deltaship serve needs the serve extra ({(e.name or 'a package').split('.')[0]} is not installed)",
            'pip install "deltaship[serve]"',
        ) from None
    opts = ServeOptions(
        host=host,
        port=port,
        api_key=api_key,
        max_sessions=max_sessions,
        cache_ram=cache_ram,
        max_queue=max_queue,
        reuse=not no_reuse,
    )
    return serve_forever(bundle, opts, threads=threads)
