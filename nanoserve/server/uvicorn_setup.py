"""How every API server process runs uvicorn: its settings, the event loop, and the start-up objects kept out
of the garbage collector's way. Shared by app.py (one server) and api_servers.py (several)."""

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from nanoserve.server.http_limits import limited_http_protocol


def uvicorn_config(app, uvicorn_log_level: str, max_header_bytes: int, header_timeout: float,
                   **kwargs) -> uvicorn.Config:
    """How every API server runs uvicorn. The drain happens before uvicorn's shutdown; its own graceful
    timeout only bounds the last sends."""
    return uvicorn.Config(app, log_level=uvicorn_log_level, access_log=False, timeout_graceful_shutdown=5,
                          http=limited_http_protocol(max_header_bytes, header_timeout), **kwargs)


@contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """While serving, what start-up allocated (modules, model, tokenizer, app: ~375k objects) is out of the garbage
    collector's reach, so that collections don't walk it again and again between chunks."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        # Given back for the collection at interpreter exit: frozen objects are never collected, and triton's
        # (cycles holding its compiler's nanobind objects) then made nanobind print ~30 lines of "leaked instances"
        # at every server's exit.
        gc.unfreeze()


def event_loop_factory():
    """uvloop where it is installed: its event loop costs a fraction of asyncio's per callback and
    socket write, and with hundreds of streams the event loop is what limits the server."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
