"""The policy: a model adapter with LoRA, guidance, memory settings and evaluation counting."""
