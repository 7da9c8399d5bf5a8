"""Text from captures and labels files made safe to print: ids, model names and file names are
whatever a client or a file held, and a terminal acts on what it is sent."""

from __future__ import annotations

import logging


class OneLineRecords(logging.Filter):
    """Log records made printable (:func:`printable`): a capture folder named with a newline split
    the proxy's "writing calls to" line in two, the second without its time stamp."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.isprintable():
            record.msg, record.args = printable(message), None
        return True


def one_line_records(logger: logging.Logger) -> None:
    """Give ``logger`` a :class:`OneLineRecords` filter once (a reloaded addon asks again)."""
    if not any(type(f).__name__ == OneLineRecords.__name__ for f in logger.filters):
        logger.addFilter(OneLineRecords())


def printable(text: object) -> str:
    """``text`` with what a terminal would act on escaped: a newline in a rollout id would split a
    table's row, an escape sequence (``ESC ]0;...``) retitle the window or clear the screen, a
    right-to-left override (U+202E) reverse the rest of the line, a zero-width space make two ids
    look alike."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def shown(text: object, limit: int = 100) -> str:
    """:func:`printable`, cut to ``limit`` characters with ``…``: a 5-million-character rollout id
    in a rewards file was echoed whole on one report line."""
    text = printable(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def escape_unencodable_output() -> None:
    """Text this process's stdout/stderr encoding cannot show (``PYTHONIOENCODING=ascii``,
    a non-UTF-8 locale: an ``é`` in a folder's name or a rollout id) is written escaped
    (``\\xe9``) instead of raising UnicodeEncodeError: a finished build exited 2 "error" without
    its table, and mitmdump stopped at start on the addon's own log line naming its folder."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        # strict, or surrogateescape (a C/POSIX locale without UTF-8 mode): both raise on an é
        if reconfigure is not None and getattr(stream, "errors", None) in ("strict", "surrogateescape"):
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream that cannot change now: left as it is
                pass
