"""The package list, the one part of the build pyproject.toml cannot say: it can find packages
or name them, not both. nummon's own subpackages are found; nummon.integrations and
nummon.configs are named, their folders mapped in pyproject.toml's [tool.setuptools.package-dir]."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["nummon", "nummon.*"]), "nummon.integrations", "nummon.configs"])
