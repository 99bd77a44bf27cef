"""Redirects and credentials: an HTTP client that never lets urllib follow a redirect on its own
(it would re-send the Authorization header to wherever ``Location`` points), and the origin
test for the clients that follow one themselves, to the same origin only."""

from __future__ import annotations

import urllib.parse
import urllib.request

__all__ = ["NoRedirect", "origin"]


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is final (an HTTPError): urllib would re-send the request, a POST as a
    body-less GET, with the Authorization header, to wherever `Location` points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        return None


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the port made explicit: what credentials are bound to."""
    p = urllib.parse.urlsplit(url)
    scheme = p.scheme.lower()
    try:
        port = p.port
    except ValueError:
        port = None
    return scheme, (p.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)
