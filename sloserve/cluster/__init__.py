"""Cluster scheduler: routing across instances (autoscaling, migration and disaggregation to come)."""
