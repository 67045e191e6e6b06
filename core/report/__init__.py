"""What a run reports: rank-0 logging to TensorBoard, metrics.jsonl, the console and W&B (`logging`, `wandb_log`),
the pictures it logs (`pictures`) and the counting metrics the stages share (`metrics`)."""
