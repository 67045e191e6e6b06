"""The manifest of every mimpipe export: a JSON file beside the weights saying how they were made (the encoder
exports of core/engine/export.py, the tokenizer exports of pretrain/train_tokenizer.py), which fine-tuning and
BEiT-style pretraining read back. Only its name lives here, where model code may import it without the engine."""

MANIFEST_NAME = "mimpipe.json"
"""The manifest's file name inside an export folder."""
