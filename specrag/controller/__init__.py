"""The query core: one run per query (staged search, speculation, adoption), the prefill gate,
sessions, timelines and modes. Knows nothing of HTTP."""
