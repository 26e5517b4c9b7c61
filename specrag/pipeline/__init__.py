"""The document store, prompts as token IDs, and the engines that prefill and decode them
(vLLM in-process, HTTP, Ray replicas)."""
