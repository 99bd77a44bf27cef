"""The adapters to the frameworks and loggers people already use (Lightning, the Hugging Face
`Trainer`, TensorBoard, W&B, MLflow, Prometheus): the only code that imports them, lazily, with
an install hint naming the extra. Imports as `nummon.integrations`.

May import: `_support`, `nummon`.
"""
