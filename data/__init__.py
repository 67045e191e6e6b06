"""Data: shard writing (`write`, `sources`, `python -m data`), streaming loaders (`pipeline`) and `transforms`."""
