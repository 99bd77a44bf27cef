"""How the watcher's messages read where people see them: Slack mrkdwn for webhooks, plain text
for the console and fallbacks, titles cut at a word, plurals, and URLs without their secrets."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from .text import cut_at_word, plural
from .text import plain_text as plain

__all__ = ["mrkdwn", "plain", "cut_at_word", "plural", "safe_url", "raw_bytes", "printable"]

_BOLD = re.compile(r"\*\*(.+?)\*\*", re.S)


def mrkdwn(md: str) -> str:
    """CommonMark-ish text (`**bold**`, `` `code` ``, `- ` items) as Slack mrkdwn (`*bold*`)."""
    text = md.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # Slack's three escapes
    text = _BOLD.sub(r"*\1*", text)
    return "\n".join("• " + line[2:] if line.startswith("- ") else line for line in text.splitlines())


def safe_url(url: str) -> str:
    """A URL as it may be printed: its scheme and host only (paths and user:password carry
    tokens, e.g. Slack's /services/T…/B…/secret)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = parts.port
    except ValueError:
        return "(a malformed URL)"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/…" if parts.scheme else "(a URL)"


def raw_bytes(name: str) -> bytes:
    """The bytes of a path or name as the file system holds them: a name that is not UTF-8
    (decoded by Python with surrogate escapes) gets its original bytes back, never an error."""
    try:
        return name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        return name.encode("utf-8", "backslashreplace")


def printable(name: str) -> str:
    """A path or name on one printable line, valid UTF-8 (strict JSON, a console, a Slack
    message): bytes that are not UTF-8 as ``\\xff``, control characters (a newline in a folder's
    name) as ``\\n``, ``\\x1b``, and a backslash of the name itself doubled, so two names never
    print alike (a folder named with a newline and one named with a backslash and an n are two
    runs, two Alertmanager labels); every other character as it is."""
    data = raw_bytes(name)
    text = data.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
