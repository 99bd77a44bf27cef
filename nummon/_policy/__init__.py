"""Threshold policies: every threshold and window of every detector, validated strictly (presets in configs/).

May import: `_core`.
"""
