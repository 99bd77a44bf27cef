"""The few text rules every message shares: one number format, titles cut at a word, plurals,
Markdown marks dropped for plain text. Pure and dependency-free, so any layer may use them."""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["cut_at_word", "fmt_num", "plain_text", "plural"]


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
