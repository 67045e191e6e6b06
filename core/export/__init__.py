"""Everything that writes or reads an export, for every stage: `folder` writes one (timm's Hugging Face layout + the
manifest + the model card, swapped in atomically; `export_state_dict` from a recipe's model), `manifest` names its JSON
file, `card` writes and updates its README.md model card (`card_facts`: what the run's shards, hand-off record and
metrics.jsonl add; `card_names`: how it names the model and the weights its run started from), `read` reads any
checkpoint or export safely and tells its format (`hub`: an `hf-hub:ORG/NAME` through the Hugging Face cache), `push`
uploads an export to the Hub, `handoff` loads one into an encoder (resizing the position grid and patch kernel) with a
report of what was loaded, resized, mapped, dropped and initialised.

Kept elsewhere on purpose: taking the weights out of a running engine or a DeepSpeed checkpoint (collective, and
DeepSpeed's: core/engine/gather.py, fp16.py), timm's `save_for_hf` shim (core/compat/timm.py), and the stages' own
commands and hooks (`python -m pretrain export`, `python -m finetune convert`, fine-tuning's best-weights export)."""
