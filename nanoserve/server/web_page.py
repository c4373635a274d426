"""The web page at / (chat playground and live engine view): plain files from server/static/, no build step.

Served by a middleware outside GateMiddleware, so that the page loads without the API key: it holds nothing
secret, asks for the key itself when the API answers 401, and sends it with every call it makes (its chat and
the /v1/engine/* endpoints stay behind the key). Only the files in static/ are served, by name: no path reaches
anything else.
"""

from pathlib import Path

from starlette.responses import FileResponse

STATIC_DIR = Path(__file__).parent / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png", ".txt": "text/plain"}


class WebPage:
    """Plain ASGI middleware: GET / and GET /static/<file> answered here, anything else passed on."""

    def __init__(self, app, static_dir: Path = STATIC_DIR) -> None:
        self.app = app
        files = sorted(p for p in static_dir.iterdir() if p.is_file() and p.suffix in _TYPES)
        self.routes = {f"/static/{p.name}": p for p in files}
        if (index := static_dir / "index.html").is_file():
            self.routes["/"] = index

    async def __call__(self, scope, receive, send) -> None:
        path = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if path is None or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        # no-cache: the browser revalidates (ETag), so a page open across a server upgrade gets the new files.
        response = FileResponse(path, media_type=_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})
        await response(scope, receive, send)
