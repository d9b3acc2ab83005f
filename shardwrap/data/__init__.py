"""Data order that survives a resume at another world size (``sampler.ResumableSampler``)."""
