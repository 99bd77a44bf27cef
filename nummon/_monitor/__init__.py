"""The Monitor: the one object a training loop touches, wiring the statistics, the engine, forensics, recovery, the report and sinks.

May import: `_core`, `_policy`, `_logs`, `_sinks`, `_stats`, `_engine`, `_forensics`, `_report`.
"""
