"""The tools around a run: replay, checkpoint audit, overfit one batch, the debugging checklist's helpers and the demo. Imports every layer below the CLI."""
