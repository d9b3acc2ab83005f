"""Offline memory estimate: imports only layout/ and base/ (no process group)."""
