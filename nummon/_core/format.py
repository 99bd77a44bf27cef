"""Shared formatting of records and alerts for sinks and the CLI (plain data in, text out)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .alert_text import threshold_text, value_text
from .text import clean_text, cut_at_word, fmt_num, plain_text, plural
from .types import Alert

__all__ = [
    "TABLE_COLUMNS",
    "alert_text",
    "clean_text",
    "cut_at_word",
    "fmt_num",
    "plain_text",
    "plural",
    "records_table",
]

TABLE_COLUMNS = ("step", "loss", "grad_norm", "activation_max", "optim_state_norm", "health")


# C0/C1 control characters (ANSI escapes start with ESC) and lone surrogates, which a terminal
# would act on or an encoder would refuse


def records_table(
    rows: Iterable[dict[str, Any]], columns: tuple[str, ...] = TABLE_COLUMNS, markdown: bool = False
) -> str:
    """A small fixed-width (or markdown) table of step records."""
    rows = list(rows)
    cells = [
        [fmt_num(r.get(c)) if r.get("step") != "..." else ("..." if c == "step" else "") for c in columns] for r in rows
    ]
    if markdown:
        head = "| " + " | ".join(columns) + " |"
        sep = "|" + "|".join("---" for _ in columns) + "|"
        return "\n".join([head, sep] + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max([len(col)] + [len(c[i]) for c in cells]) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def alert_text(alert: Alert, markdown: bool = False) -> str:
    """The alert body: step, metric, value, threshold, location, hint and, for critical alerts,
    the last steps of the flight recorder as a table."""
    lines = [
        f"{alert.severity.value.upper()} {alert.kind.value} at step {alert.step}: {alert.message}",
    ]
    said = value_text(alert.kind, alert.metric, alert.value, alert.details, alert.location)
    limit = threshold_text(alert.kind, alert.metric, alert.threshold, alert.details)
    if said or limit:
        lines.append("  ".join(x for x in (said and f"value: {said}", limit and f"limit: {limit}") if x))
    if alert.location:
        lines.append(f"location: {alert.location}")
    if alert.rank is not None:
        lines.append(f"rank: {alert.rank}")
    if alert.hint:
        lines.append(f"hint: {alert.hint}")
    recent = alert.details.get("recent") if alert.details else None
    if recent:
        lines.append("")
        lines.append("last steps (flight recorder):")
        table = records_table(recent, markdown=markdown)
        lines.append(table if markdown else "```\n" + table + "\n```")
    if alert.flight_record:
        lines.append(f"flight record: {alert.flight_record}")
    sep = "  \n" if markdown else "\n"
    return sep.join(lines)
