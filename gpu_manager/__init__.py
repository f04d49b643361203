"""The per-node GPU manager: devices, function packages, one worker process per cached model."""
