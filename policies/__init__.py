"""Policies: adaptive speculation, SLO-aware routing and autoscaling."""
