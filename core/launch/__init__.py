"""Before the processes start: launch.sh's check of the recipe, topology and batch split (`check`), pre-flight of the
recipe's files, device and disk (`preflight`), one run per run_dir (`rundir`), the GPUs a node may use (`gpus`),
checkpoint sizes and free space (`disk`), and torchrun with a one-line failure report (`torchrun`)."""
