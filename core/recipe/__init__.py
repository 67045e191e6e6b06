"""The recipe schema: typed sections (`sections`, `model_config`), the `Config` tree with YAML loading, dotted
overrides and dump (`config`), `base:` inheritance (`tree`), close-match errors (`errors`) and the per-arch token
geometry (`geometry`). Imports no model code: loading a recipe does not import timm's models."""
