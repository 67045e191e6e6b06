"""Shims over DeepSpeed, timm and webdataset internals, and the checks that guard them."""
