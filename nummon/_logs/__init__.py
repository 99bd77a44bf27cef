"""Log readers (no torch): nummon JSONL, TensorBoard, Hugging Face, Lightning CSV, W&B offline runs and MLflow, followed incrementally and found under a root.

May import: `_core`.
"""
