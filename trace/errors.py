"""Expected errors of the pipeline, and how a command-line entry point reports them.

``UserError`` is the base of every error a user can cause and fix: a bad param (``trace.configuration.config.ConfigError``),
a missing or malformed data file (``trace.data_paths.DataError``), a damaged prepared-prompt, tree or checkpoint
file (``trace.prepared.PreparedFileError``, ``trace.tree_io.TreeFileError``, ``trace.training.checkpoint.CheckpointError``),
a retriever that does not answer (``trace.envs.retrieval.RetrieverError``), a reward of the wrong type
(``trace.tree.RewardError``). Its message names the file, row or key and says how to fix it. Each subclass also
derives from the builtin it replaces (``ValueError``, ``RuntimeError``), so code that caught those still does.

``user_errors()`` wraps a command-line entry point: a ``UserError`` ends the process with its message alone on
standard error and exit status 1; ``TRACE_DEBUG=1`` shows the traceback instead. Any other exception is a bug
and keeps its traceback. ``quiet_orchestrator_tracebacks()`` stops Prefect from printing the traceback of a
``UserError`` that leaves a flow or task run (the run still ends Failed, with the message as its state).

Standard library only: every module of the library may import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

DEBUG_ENV = "TRACE_DEBUG"
EXIT_STATUS = 1
_PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class UserError(Exception):
    """An expected error whose message names the file, row or key at fault and how to fix it."""


def debug_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``TRACE_DEBUG`` asks for tracebacks of expected errors (any value but ``""``, ``0``, ``false``)."""
    value = (os.environ if environ is None else environ).get(DEBUG_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no")


def format_user_error(err: BaseException) -> str:
    """The one-block message printed for an expected error: ``error: <message>`` and the debug hint."""
    return f"error: {err}\n(set {DEBUG_ENV}=1 to see the traceback)"


class _DropUserErrorTracebacks(logging.Filter):
    """Drops the orchestrator's 'Encountered exception' record of a ``UserError`` (it is reported once, by
    ``user_errors``); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if debug_enabled() or not record.exc_info:
            return True
        return not isinstance(record.exc_info[1], UserError)


_FILTER = _DropUserErrorTracebacks()


def quiet_orchestrator_tracebacks() -> None:
    """Keep Prefect's run loggers from printing the traceback of a ``UserError`` (idempotent).

    Prefect logs ``Encountered exception during execution`` with the traceback before it marks a flow or task
    run Failed and re-raises; the message reaches the user through ``user_errors`` instead.
    """
    for name in _PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Report a ``UserError`` raised inside as one message on standard error and exit with status 1.

    Under ``TRACE_DEBUG=1`` the error propagates with its traceback. Other exceptions always propagate.

    Raises:
        SystemExit: status 1, after printing ``format_user_error`` of the error.
    """
    quiet_orchestrator_tracebacks()
    try:
        yield
    except UserError as err:
        if debug_enabled():
            raise
        print(format_user_error(err), file=sys.stderr)
        raise SystemExit(EXIT_STATUS) from None
