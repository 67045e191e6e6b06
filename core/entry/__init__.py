"""The entry points above the stages: `mimpipe COMMAND` (cli.py), launch.sh's pre-launch check (launch_check.py),
a stage's start under `python -m pretrain|finetune` (stage.py) and `mimpipe status` (status.py, status_screen.py). The
only part of core that reaches the stages: the rest of core imports no stage (tests/unit/test_layers.py)."""
