"""Drafters: one module per method behind the `Drafter` interface (base.py)."""
