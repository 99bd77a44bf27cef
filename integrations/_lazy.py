"""The lazy-import helper lives below the core (`nummon._lazy`); the integrations import it from here."""

from nummon._lazy import require

__all__ = ["require"]
