"""Shims over DeepSpeed (`deepspeed`), timm (`timm`) and webdataset (`webdataset`): every place we lean on a library's
internals, checked against the versions they were written for. Imports nothing of ours, so every layer may use it."""
