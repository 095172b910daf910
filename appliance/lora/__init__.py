"""Multi-LoRA: PEFT adapters, registry, CPU cache, GPU slot pool, batch info and LoRA layers."""
