"""Offline GRPO + LoRA training on captured trajectories (``polar-train train``)."""
