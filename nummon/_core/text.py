"""The text rules every message shares: one number format, titles cut at a word, plurals,
Markdown marks dropped for plain text or turned into Slack mrkdwn, printable names, URLs without
their secrets. Pure and dependency-free, so any layer may use them (the words for alerts and
records, which need the types, are `alert_text.py`)."""

from __future__ import annotations

import math
import re
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "clean_text",
    "cut_at_word",
    "fmt_num",
    "mrkdwn",
    "plain_text",
    "plural",
    "printable",
    "raw_bytes",
    "safe_url",
]


def fmt_num(v: Any, none: str = "—") -> str:
    """The one number format of tables and messages: integers exactly, floats to 4 significant
    digits, non-finite as nan/inf/-inf, None as `none`."""
    if v is None:
        return none
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return f"{v:.4g}"


def cut_at_word(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, cut at a word boundary (when one falls in the second
    half) with an ellipsis, trailing punctuation dropped before it."""
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    if space >= limit // 2:
        head = head[:space]
    return head.rstrip(" :,;-") + "…"


def plural(n: float, word: str, many: str | None = None) -> str:
    """'1 step', '3 steps', '2 tries': `n` rounded to an integer, `many` the plural when it is not
    regular (default: the word + s, or y -> ies after a consonant)."""
    k = int(round(n))
    if k == 1:
        return f"{k} {word}"
    if many is None:
        many = word[:-1] + "ies" if word.endswith("y") and word[-2:-1] not in "aeiou" else word + "s"
    return f"{k} {many}"


_BOLD = re.compile(r"\*\*(.+?)\*\*", re.S)
_CODE = re.compile(r"`([^`\n]*)`")


def plain_text(markdown: str) -> str:
    """Markdown as a terminal shows it best: **bold** and `code` marks dropped, text kept."""
    return _CODE.sub(r"\1", _BOLD.sub(r"\1", markdown))


_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_text(text: str, one_line: bool = True) -> str:
    """`text` safe to print: control characters and lone surrogates escaped (\\x1b, \\ud800),
    and with `one_line` newlines and tabs folded to spaces."""
    if one_line:
        text = " ".join(text.split()) if ("\n" in text or "\r" in text or "\t" in text) else text
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)


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
