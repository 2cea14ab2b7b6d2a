"""Parallelism: the process groups and how a model is spread over them (data parallel and ZeRO-1, FSDP2, tensor and
pipeline parallel), and what sharded gradients need (clipping)."""
