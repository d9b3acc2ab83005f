"""Operations on a wrapped model: gradient clipping, summoning, forward methods, batch weight, grad
scaler.
"""
