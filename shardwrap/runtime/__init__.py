"""One training step across units: step bookkeeping, schedule, buckets, registry (the hooks are
``hooks.py``).
"""
