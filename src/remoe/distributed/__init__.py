"""Parallelism applied from outside the model: process-group set-up (``setup``), expert
parallelism (``expert_parallel``), FSDP2 (``fsdp``) and sharded DCP checkpoints (``dcp``)."""
