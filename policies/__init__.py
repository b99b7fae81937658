"""Cluster-level policies: request routing across replicas, autoscaling, SLO classes.

The in-step speculation policy (tree shapes and verification budgets) is part of the step executor:
engines/spec_decode/policy.py.
"""
