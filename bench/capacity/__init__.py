"""Capacity of specrag's own per-answer work in front of fast replicas."""
