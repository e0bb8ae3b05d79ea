"""An OpenAI-compatible HTTP server on the :class:`~kvcache_ext.Engine` (FastAPI + uvicorn).

``create_app(model, tokenizer, cache, model_name, ...)`` builds the app (``app.py``: routes;
``protocol.py``: the request and response bodies; ``engine_thread.py``: the thread that owns the
Engine; ``metrics.py``: Prometheus metrics); :func:`serve` runs it.
"""

from __future__ import annotations

import signal

import uvicorn

from .app import create_app

__all__ = ["create_app", "serve"]

# Seconds a shutdown (SIGTERM, SIGINT) waits for open requests before the engine thread stops and
# fails what is left.
SHUTDOWN_GRACE_SECONDS = 30


def serve(
    app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", grace: float = SHUTDOWN_GRACE_SECONDS
):
    """Serve ``app`` with uvicorn until SIGTERM or SIGINT (loopback unless ``host`` says otherwise);
    requests still open at a signal get ``grace`` seconds to finish, then it returns (the process
    exits 0: a stop asked for is not a failure)."""
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace)
    )
    # uvicorn handles SIGTERM/SIGINT (a graceful shutdown), then raises the signal again for the handler
    # that was there before it: this one, which ends the serving instead of the process.
    previous = {sig: signal.signal(sig, _stop_serving) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    except _StopServing:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _StopServing(Exception):
    """A stop signal that reached :func:`serve` after uvicorn's shutdown."""


def _stop_serving(signum, frame):
    raise _StopServing
