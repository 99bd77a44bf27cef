"""Threshold policies and presets: every threshold and window, validated strictly. Imports `_core`."""
