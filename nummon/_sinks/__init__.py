"""Sinks: where step records, histograms, alerts and incident events go, each on its own thread behind the dispatcher; the chart layout the charting sinks share.

May import: `_core`.
"""
