"""A declarative, config-driven appliance for serving many LoRA adapters on one base LLM."""

__version__ = "0.1.0"
