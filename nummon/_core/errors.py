"""Errors with one-line messages that name the problem."""

__all__ = ["DistributedError", "NummonError", "StateError", "TraceError"]


class NummonError(ValueError):
    """Base of nummon's errors: the message is one line and names the problem."""


class DistributedError(NummonError, RuntimeError):
    """A collective failed (a rank died or is out of step, a timeout passed) or the ranks packed
    different statistics."""


class StateError(NummonError):
    """A saved state (a health engine's `state_dict`, a checkpoint's nummon state) that cannot be
    loaded: wrong types or values. Nothing was changed."""


class TraceError(NummonError):
    """A trace file that cannot be read; the message names the file and line."""
