"""The manifest of every mimpipe export: a JSON file beside the weights saying how they were made (the encoder
exports of core/export/folder.py, the tokenizer exports of pretrain/train_tokenizer.py), which fine-tuning and
BEiT-style pretraining read back. Only its name lives here, for the readers that need nothing else of core.export."""

MANIFEST_NAME = "mimpipe.json"
"""The manifest's file name inside an export folder."""
