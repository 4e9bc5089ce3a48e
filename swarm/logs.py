"""Logging for the entry points: one line per record, with the peer, block span and session fields when present;
as text for people, or (``--log-format json``) as one JSON object per line for log collectors. Progress bars are
drawn only where a person watches them: text logs on a terminal (``progress_bars``); elsewhere the work they show
becomes log records, and Hugging Face's own bars are switched off."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime

from swarm.hf_calls import disable_progress_bar

FIELDS = ("peer", "span", "session", "kind", "progress")  # progress: {"files": [done, of], "bytes": [...]}
FORMATS = ("text", "json")
_format = "text"  # what configure_logging set: a library caller that never called it logs text
# The standard names, whatever a library renamed them to (hivemind shortens WARNING): JSON consumers match on them.
LEVELS = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}


class FieldFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(f"{k}={getattr(record, k)}" for k in FIELDS if getattr(record, k, None) is not None)
        return f"{line} [{extras}]" if extras else line


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg"}``, the fields above when the record carries them, and ``exc_info`` (the
    formatted traceback) when it has one; a field that JSON cannot hold is written as its ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": LEVELS.get(record.levelno, record.levelname),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def formatter(fmt: str = "text") -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return FieldFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    raise ValueError(f"log format is one of {', '.join(FORMATS)}, got {fmt!r}")


def progress_bars() -> bool:
    """Whether a progress bar may be drawn on stderr: only into text logs (a bar in a JSON log is a line no collector
    parses) and only on a terminal (in a file its redraws are noise). Where not, report the steps as log records."""
    return _format == "text" and sys.stderr.isatty()


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Every record to stderr in ``fmt`` ("text" or "json"), at ``level`` and above."""
    global _format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _format = fmt
    if fmt == "json":
        # hivemind and transformers log through text handlers of their own that stop propagation, and Python's
        # warnings print straight to stderr: route all three through the root handler so every line is JSON
        from hivemind.utils.logging import use_hivemind_log_handler
        from transformers.utils import logging as transformers_logging

        use_hivemind_log_handler("nowhere")
        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()
        logging.captureWarnings(True)
    if not progress_bars():
        _hide_library_bars()
    for noisy in ("hivemind", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel("WARNING")


def _hide_library_bars() -> None:
    """Switch off the bars Hugging Face draws on stderr: transformers' ("Loading weights" of every
    ``from_pretrained``, "Writing model shards" of every ``save_pretrained``: the first start of a random card writes
    its folder) and huggingface_hub's. Both switches are process-wide, and a fork of this process keeps them."""
    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()
    disable_progress_bar()


def add_log_flags(parser: argparse.ArgumentParser, level: str = "INFO") -> None:
    """``--log-level`` and ``--log-format`` of an entry point (give both to ``configure_logging``)."""
    parser.add_argument(
        "--log-level", default=level, type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    )
    parser.add_argument(
        "--log-format", choices=FORMATS, default="text", help="log lines as text, or one JSON object each"
    )
