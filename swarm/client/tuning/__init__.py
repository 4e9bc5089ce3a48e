"""The client's trainable adapters (LoRA pairs, prompts) and which servers hold them, the adapter a model is asked for,
and PEFT's format."""
