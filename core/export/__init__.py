"""Everything that writes or reads an export, for every stage: `folder` writes one (timm's Hugging Face layout +
the manifest, swapped in atomically; `export_state_dict` from a recipe's model), `manifest` names its JSON file,
`read` reads any checkpoint or export safely and tells its format, `handoff` loads one into an encoder (resizing the
position grid and patch kernel) with a report of what was loaded, resized, mapped, dropped and initialised.

Kept elsewhere on purpose: taking the weights out of a running engine or a DeepSpeed checkpoint (collective, and
DeepSpeed's: core/engine/gather.py, fp16.py), timm's `save_for_hf` shim (core/compat/timm.py), and the stages' own
commands and hooks (`python -m pretrain export`, `python -m finetune convert`, fine-tuning's best-weights export)."""
