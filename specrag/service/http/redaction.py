"""Session ids stay out of the logs.

A session id is all it takes to name a session, and ``DELETE /v1/sessions/{id}`` carries it in
the path, which aiohttp's access log prints (in the message and in the record's extra fields,
which a JSON log handler writes out). A filter on the access logger rewrites each record before
any handler sees it, whatever the log format: the id becomes ``<session>``.
"""

from __future__ import annotations

import logging
import re

__all__ = ["REDACTED", "SessionIdRedaction", "redact", "redact_session_ids"]

REDACTED = "<session>"
_SESSION_PATH = re.compile(r"(/v1/sessions/)[^\s\"'?#]+")


def redact(text: str) -> str:
    """``text`` with the id after every ``/v1/sessions/`` replaced by :data:`REDACTED`."""
    return _SESSION_PATH.sub(rf"\g<1>{REDACTED}", text)


class SessionIdRedaction(logging.Filter):
    """Rewrites a record's message, arguments and text fields without the session ids in them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in record.args)
        for name, value in list(vars(record).items()):
            if name not in ("msg", "args") and isinstance(value, str) and "/v1/sessions/" in value:
                setattr(record, name, redact(value))
        return True


def redact_session_ids(logger: logging.Logger) -> None:
    """Install the filter on ``logger`` (once, however often called)."""
    if not any(isinstance(existing, SessionIdRedaction) for existing in logger.filters):
        logger.addFilter(SessionIdRedaction())
