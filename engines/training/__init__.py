"""Drafter training: data preparation (data.py); training loops come with the drafters that need them."""
