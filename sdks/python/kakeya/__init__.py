"""Kakeya Python SDK (placeholder, filled in below)."""
