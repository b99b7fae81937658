"""Drafter training: data (data.py), target features (features.py), the loop (train_drafter.py), Ray Train
workers (ray_train.py), curves and model card (report.py), and the command tying them (pipeline.py)."""
