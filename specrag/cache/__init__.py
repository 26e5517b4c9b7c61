"""The knowledge tree: a mirror of the engine's prefix cache that decides document order.

Owns no KV and talks to no network or engine; depends on nothing else of specrag's.
"""
