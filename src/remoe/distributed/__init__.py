"""Parallelism applied from outside the model: process-group set-up, expert parallelism, FSDP2 and sharded (DCP) checkpoints, and the safe reader of DCP metadata."""
