"""Parallelism for titanlite: data parallelism (own bucketed engine), tensor parallelism, FSDP."""
