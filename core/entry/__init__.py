"""The entry points above the stages: `mimpipe COMMAND` (cli.py) and launch.sh's pre-launch check (launch_check.py).
The only part of core that reaches the stages: the rest of core imports no stage (tests/unit/test_layers.py)."""
