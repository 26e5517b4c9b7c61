"""The query core: the controller (what queries share) and one run per query (staged search,
speculation, adoption), the prefill gate, warm-up, sessions and their turns' prompts, decoding
settings, timelines, modes, and the facade front ends use. Knows nothing of HTTP."""
