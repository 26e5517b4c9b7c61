"""Text embedders: one interface, the kinds an index names, and how they batch and show progress."""
