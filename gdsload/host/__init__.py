"""Facts about this host and process (GPU choice, memory, torch.distributed, fork safety).

Standard library and NumPy only; CuPy and torch are imported on first use."""
