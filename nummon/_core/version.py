"""nummon's version: one place, read by the package's face and the command line."""

__all__ = ["__version__"]

__version__ = "0.1.0"
