"""Tensor parallelism: layout, process group, weight and LoRA sharding, worker processes, launcher."""
