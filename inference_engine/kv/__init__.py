"""Per-session resident KV caches (one module per strategy), their stores and compressors."""
