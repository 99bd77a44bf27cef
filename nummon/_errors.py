"""Errors with one-line messages that name the problem."""


class NummonError(ValueError):
    """Base of nummon's input errors: the message is one line and names the problem."""
