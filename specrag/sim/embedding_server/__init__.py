"""A GPU-pace stand-in for an embedding server: OpenAI's ``/v1/embeddings`` with real MiniLM
vectors, timed by a model, never a default.

``python -m specrag.sim.embedding_server`` answers what
:class:`~specrag.retrieval.embedders.http_embedder.OpenAIEmbedder` asks of vLLM's or Text
Embeddings Inference's server: the vectors are the project's own MiniLM embedder's, each text
embedded alone (as the service embeds a question) and kept by text, so they equal the in-process
embedder's; texts named at start are embedded before it serves, so that a benchmark measuring
specrag's work meanwhile leaves it no CPU to spend. Requests are served in batches, each taking a
fixed time (a GPU's pass over a small encoder, docs/capacity.md derives the figure): it measures a
front end whose questions are embedded elsewhere, never an embedding model's latency.
"""
