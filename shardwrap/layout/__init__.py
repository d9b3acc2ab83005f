"""Pure arithmetic and tree decisions: flat layout, gradient slots, parameter partition,
persistence rule (the wrap policies are ``policies.py``)."""
