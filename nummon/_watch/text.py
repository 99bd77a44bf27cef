"""How the watcher's messages read where people see them: Slack mrkdwn for webhooks, plain text
for the console and fallbacks, titles cut at a word, plurals, and URLs without their secrets."""
from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["mrkdwn", "plain", "cut_at_word", "plural", "safe_url"]

_BOLD = re.compile(r"\*\*(.+?)\*\*", re.S)
_CODE = re.compile(r"`([^`\n]*)`")


def mrkdwn(md: str) -> str:
    """CommonMark-ish text (`**bold**`, `` `code` ``, `- ` items) as Slack mrkdwn (`*bold*`)."""
    text = md.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # Slack's three escapes
    text = _BOLD.sub(r"*\1*", text)
    return "\n".join("• " + line[2:] if line.startswith("- ") else line for line in text.splitlines())


def plain(md: str) -> str:
    """The same text with its markup removed (console lines, notification fallbacks)."""
    text = _BOLD.sub(r"\1", md)
    return _CODE.sub(r"\1", text)


def cut_at_word(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, cut at a word boundary with an ellipsis."""
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    if space >= limit // 2:
        head = head[:space]
    return head.rstrip(" :,;-") + "…"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 try', '2 tries', '1 notification', '3 notifications'."""
    if n == 1:
        return f"{n} {word}"
    if many is None:
        many = word[:-1] + "ies" if word.endswith("y") and word[-2:-1] not in "aeiou" else word + "s"
    return f"{n} {many}"


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
