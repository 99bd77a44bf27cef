"""Sinks: where step records, histograms, alerts and incident events go, each on its own thread behind the dispatcher. Imports `_core` and `_policy`."""
