"""`python -m launch`: launch.sh's pre-launch check (core/launch.py) with each stage's own checks. It sits above
the stages, so that core never imports one."""
