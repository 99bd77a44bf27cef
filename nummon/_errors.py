"""Errors with one-line messages that name the problem."""

__all__ = ["NummonError"]


class NummonError(ValueError):
    """Base of nummon's input errors: the message is one line and names the problem."""
