"""The only user of torch.distributed collectives: communicators, pairwise exchange, posting,
groups.
"""
