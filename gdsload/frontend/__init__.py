"""What both loaders (`DataLoader` and `RemoteLoader`) present to the training loop: options,
the cursor, field kinds, output conversion and user code (`map`, `collate_fn`, worker processes)."""
