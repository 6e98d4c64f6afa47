"""Decoders: raw tensors (no decode step) and images (DALI, "mixed" on GPU hosts, "cpu" otherwise)."""
