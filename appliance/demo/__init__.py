"""Demo LoRA adapters for the default model (pirate, french): hand-written data/, train.py that makes them
with peft on CPU, samples.py that shows what they change, and the trained adapters/ shipped in the package."""
