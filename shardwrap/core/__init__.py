"""One unit: gradients, gradient buffers, precision record, shard storage, the Unit record (the
handle is ``flat_param.py``).
"""
