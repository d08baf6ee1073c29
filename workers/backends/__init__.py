"""Model backends behind one protocol (base.py): the real Fuyu loader and an in-process echo model."""
