"""``Console``: the web console's static files, served by the gateway through the edge.

The console is plain HTML, CSS and JavaScript in ``services/gateway/static/`` (package data: no
build step, nothing fetched at run time). The Envoy edge transcodes ``GET /`` and
``GET /console/{name}`` into the gateway's ``GetConsoleFile`` RPC, so the page comes from the same
origin as the API it calls (``/v1/models``, ``/v1/chat/completions``, ``/v1/status``) and works
wherever the edge runs, on a laptop or behind the Helm chart's edge, with no file to mount. The
files are read once, when the gateway starts; an unknown name answers 404.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().with_name("static")
INDEX = "index.html"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


@dataclass(frozen=True)
class ConsoleFile:
    status: int
    content_type: str
    body: bytes


NOT_FOUND = ConsoleFile(404, "text/plain; charset=utf-8", b"not found\n")


class Console:
    """The files of ``folder`` by name (those with a known content type)."""

    def __init__(self, folder: Path = STATIC_DIR) -> None:
        self.files = {path.name: ConsoleFile(200, CONTENT_TYPES[path.suffix], path.read_bytes())
                      for path in sorted(folder.iterdir()) if path.suffix in CONTENT_TYPES}
        if INDEX not in self.files:
            logger.warning("the web console is missing: no %s in %s", INDEX, folder)

    def get(self, name: str) -> ConsoleFile:
        """The file called ``name`` (``index.html`` when empty), or a 404 answer."""
        return self.files.get(name or INDEX, NOT_FOUND)
