"""The HTTP application: specrag's RAG API, the OpenAI-compatible chat endpoint, sessions, models,
health, metrics and the document API.

Every route is in one table, :data:`specrag.service.http.app.ROUTES`; each resource's handlers
are in a module of their own (``queries``, ``sessions``, ``models``, ``monitoring``,
``documents``); the rest is what every request passes through: ``middleware``, ``auth``,
``access`` (who may come in, how many at once), ``in_flight`` (the per-client limits and the
application's state), ``wire`` (reading requests, the error shape), ``bodies``, ``framing``,
``redaction``, and what ``/metrics`` and ``/health`` report (``metrics``, ``mirror_report``).
Imports neither :mod:`specrag.service.cli` nor :mod:`specrag.service.run`.
"""

__all__: list[str] = []
