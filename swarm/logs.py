"""Logging for the entry points: one line per record, with the peer, block span and session fields when present."""

from __future__ import annotations

import logging
import sys

FIELDS = ("peer", "span", "session", "kind")


class FieldFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(f"{k}={getattr(record, k)}" for k in FIELDS if getattr(record, k, None) is not None)
        return f"{line} [{extras}]" if extras else line


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FieldFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("hivemind", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel("WARNING")
