"""Stand-in until test_report.py imports helpers.log_writers (it is being changed on another
branch; the coordinator's move script removes this file). It holds no tests."""

from helpers.log_writers import runaway_rows, write_wandb  # noqa: F401
