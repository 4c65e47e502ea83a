"""structlog, configured once: console lines for humans, JSON lines with --log-json.

Bind the ids a line concerns (request_id, worker_id, step, policy_version) with
`structlog.contextvars.bind_contextvars` or `log.bind(...)`; a grep for one request id then
follows it through the whole fleet.
"""

from __future__ import annotations

import json
import logging
import sys

import structlog

_configured = False


class _Stderr:
    """Whatever `sys.stderr` is when a line is written, not when logging was configured: a
    stream swapped in for a while (a test's capture, a redirect) and closed since must not
    take every later log line down with it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(json: bool = False, level: str = "info") -> None:
    global _configured
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,  # `rlboost run` quiets the logs after bootstrapping
    )
    _configured = True


def get_logger(**ids: object) -> structlog.typing.FilteringBoundLogger:
    """A lazy logger: module-level loggers follow a later `configure_logging` (level, format)."""
    if not _configured:
        configure_logging()
    return structlog.get_logger(**ids)


def print_result(result: dict) -> None:
    """Benchmarks and jobs end with exactly one JSON line on stdout (beside the log lines,
    which go to stderr)."""
    print(json.dumps(result, sort_keys=False), flush=True)
