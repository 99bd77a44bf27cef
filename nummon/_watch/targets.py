"""Notification targets for incident events: console, JSONL, W&B (and the webhook in
webhook.py, Alertmanager in alertmanager.py), and `parse_target` for `--notify`. Every target
is a `Target` (output.py): the watcher uses nothing else of it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import IO, Any

from .._core.errors import NummonError
from .._core.json import dumps
from .._core.text import cut_at_word, safe_url
from .._core.text import plain_text as plain
from .notices import Notice
from .output import Outcome, OutcomeHandler, Target

__all__ = [
    "Target",
    "Outcome",
    "OutcomeHandler",
    "ConsoleTarget",
    "JsonlTarget",
    "WandbTarget",
    "parse_target",
    "TARGET_SPECS",
]

TARGET_SPECS = "console, jsonl:PATH, webhook:URL, wandb[:PROJECT], alertmanager:URL[,URL...]"


class ConsoleTarget(Target):
    """The title and summary on stdout as plain text, flushed at once (the watcher's own process)."""

    kind = "console"
    key = "console"
    shown = "console"

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def on_incident(self, notice: Notice) -> None:
        out = self.stream or sys.stdout
        body = "\n".join("    " + line for line in plain(notice.summary()).splitlines())
        out.write(f"{plain(notice.title)}\n{body}\n")
        out.flush()

    def close(self, timeout_s: float = 5.0) -> list[str]:
        return []


class JsonlTarget(Target):
    """One strict-JSON line per event, flushed and fsync'ed (it is the record of what was sent);
    events whose id is already in the file (a restart after a crash) are not written twice. A
    write that fails (a full disk) leaves no torn line and raises: the event stays pending."""

    kind = "jsonl"
    durable = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.key = "jsonl:" + os.path.abspath(path)
        self.shown = f"jsonl {path}"
        if os.path.lexists(path) and not os.path.isfile(path):
            raise NummonError(f"--notify jsonl:{path}: not a regular file")
        self._ids = self._existing_ids(path)
        parent = os.path.dirname(os.path.abspath(path))
        self._torn = _ends_torn(path)  # a fragment left by a crash mid-line: the next line starts a line of its own
        try:
            os.makedirs(parent, exist_ok=True)
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise NummonError(f"--notify jsonl:{path}: cannot write there ({e.strerror or e})") from None

    @staticmethod
    def _existing_ids(path: str) -> set[str | None]:
        ids: set[str | None] = set()
        try:
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        ids.add(json.loads(line).get("id"))
                    except (ValueError, AttributeError, RecursionError):
                        continue
        except OSError:
            pass
        return ids

    def on_incident(self, notice: Notice) -> None:
        """Append the event's line and fsync it; OSError (a full disk, a file-size limit) when
        it is not all on disk: then nothing of it stays (the file is cut back to where it was),
        and its id is not taken as written, so the watcher tries it again or reports it lost."""
        d = notice.to_dict()
        if d.get("id") in self._ids:
            return
        if self._fd is None:
            raise OSError(f"{self.path}: closed")
        line = ("\n" if self._torn else "") + dumps(d) + "\n"
        start = os.fstat(self._fd).st_size  # O_APPEND: the line goes at the end
        try:
            _write_all(self._fd, line.encode("utf-8"))
            os.fsync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, start)  # no torn line: the next event starts a line of its own
            except OSError:
                self._torn = True
            raise
        self._torn = False
        self._ids.add(d.get("id"))  # only now: an event is never marked written unless it is on disk

    def close(self, timeout_s: float = 5.0) -> list[str]:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        return []


def _ends_torn(path: str) -> bool:
    """True when a non-empty file does not end with a newline (a writer died mid-line)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except OSError:
        return False


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a short write is followed by the error that caused it)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(f"wrote nothing of {len(view)} bytes")
        view = view[n:]


class WandbTarget(Target):
    """A W&B alert on a run of the watcher's own (offline when there are no credentials)."""

    kind = "wandb"

    _LEVELS = {0: "INFO", 1: "WARN", 2: "ERROR", 3: "ERROR"}

    def __init__(self, project: str = "nummon-watch", make_sink: Callable[..., Any] | None = None) -> None:
        if make_sink is None:  # the W&B sink is an integration: the command line hands it over
            raise NummonError("--notify wandb: the W&B integration was not given to the watcher")
        self.key = f"wandb:{project}"
        self.shown = f"W&B project {project}"
        try:
            self._sink = make_sink(project=project, job_type="watch")
        except ImportError as e:
            raise NummonError(str(e)) from None
        self.sent: list[tuple[str, str]] = []
        self._closed = False

    def on_incident(self, notice: Notice) -> None:
        level = self._LEVELS.get(notice.level, "WARN")
        self._sink.run.alert(
            title=cut_at_word(plain(notice.title), 63), text=notice.summary(), level=level, wait_duration=1
        )
        self.sent.append((notice.title, level))

    def close(self, timeout_s: float = 5.0) -> list[str]:
        if not self._closed:
            self._closed = True
            self._sink.close()
        return []


def parse_target(spec: str, wandb_sink: Callable[..., Any] | None = None) -> Target:
    """A target from its command-line spec; NummonError naming a bad one. `wandb_sink` makes
    the W&B target's sink (`WandbSink`, from the integrations layer)."""
    kind, _, arg = spec.partition(":")
    if kind == "console" and not arg:
        return ConsoleTarget()
    if kind == "jsonl" and arg:
        return JsonlTarget(arg)
    if kind == "webhook" and arg:
        from .webhook import WebhookTarget

        return WebhookTarget(arg)
    if kind == "alertmanager" and arg:
        from .alertmanager import AlertmanagerTarget

        return AlertmanagerTarget(arg)
    if kind == "wandb":
        return WandbTarget(arg or "nummon-watch", wandb_sink)
    raise NummonError(f"--notify {_shown_spec(kind, arg)!r}: expected one of {TARGET_SPECS}{_did_you_mean(kind)}")


_KINDS = ("console", "jsonl", "webhook", "wandb", "alertmanager")


def _shown_spec(kind: str, arg: str) -> str:
    """A target spec as it may be printed: every URL in it (a misspelled kind's too, a comma list
    of them) as scheme and host only, and anything that may hold a user:password left out."""
    if not arg:
        return kind
    if "://" in arg:
        return f"{kind}:" + ",".join(safe_url(u) for u in arg.split(","))
    if len(arg) <= 32 and not any(c in arg for c in "@/:?=&#"):
        return f"{kind}:{arg}"  # a short plain word (a project, a name): nothing secret in it
    return f"{kind}:…"  # a path or token we cannot take apart: never printed


def _did_you_mean(kind: str) -> str:
    import difflib

    near = difflib.get_close_matches(kind.lower(), _KINDS, n=1, cutoff=0.6)
    return f" (did you mean {near[0]}:?)" if near and near[0] != kind else ""
