"""The detection core (no torch): detectors, the health engine, incidents, outcomes, hints and log segments. Imports `_core` and `_policy`."""
