"""An OpenAI-compatible HTTP server on the :class:`~kvcache_ext.Engine` (FastAPI + uvicorn).

``create_app(model, tokenizer, cache, model_name, ...)`` builds the app (``app.py``: routes;
``protocol.py``: the request and response bodies; ``engine_thread.py``: the thread that owns the
Engine; ``metrics.py``: Prometheus metrics); :func:`serve` runs it.
"""

from __future__ import annotations

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
    requests still open at a signal get ``grace`` seconds to finish."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace)
