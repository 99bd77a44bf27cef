"""The tools around a run: replay, checkpoint audit, overfit one batch, the debugging checklist's helpers and the demo.

May import: `_core`, `_policy`, `_logs`, `_sinks`, `_stats`, `_engine`, `_forensics`, `_report`, `_monitor`, `_watch`, `_support`, `integrations`.
"""
