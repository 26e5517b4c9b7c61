"""The staged search every backend runs: stage plans and results, learned stage values, its threads."""
