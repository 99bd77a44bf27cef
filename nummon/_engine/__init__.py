"""The detection core (no torch): detectors, the health engine, incidents, outcomes, hints and log segments.

May import: `_core`, `_policy`.
"""
