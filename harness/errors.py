"""The errors a user can fix: one base class, printed as one line with no traceback.

Every error whose message already names the bad value and its fix subclasses :class:`UserError`.
The command line (:func:`harness.cli.main`, ``python -m harness``) catches ``UserError`` alone,
prints ``error: <message>`` and exits with the error's :attr:`~UserError.exit_code` (or the
tool's own status for bad input); anything else is a bug and keeps its traceback.

This module is the bottom of the package: it imports nothing from ``harness``, so any module
can raise a user error without importing the command line.
"""
from __future__ import annotations

EXIT_USAGE = 2


class UserError(Exception):
    """A problem the user can fix; the message names the bad value and what is valid."""

    exit_code: int = EXIT_USAGE


class UsageError(UserError, ValueError):
    """A command line or config that cannot be run; the message names the argument and what is valid."""


class ModelLoadError(UserError, RuntimeError):
    """A model source that cannot be loaded (missing, gated, offline, wrong format); says what to do."""


class TrackingError(UserError, RuntimeError):
    """The MLflow tracking store cannot be reached or written; says how to log the results later."""
