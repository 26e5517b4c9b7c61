"""The running service around the query core, in three rooms by layer; each imports only the rooms
after it in this list (tests/test_dependency_direction.py):

- :mod:`specrag.service.cli`: the command lines of ``specrag prepare``, ``serve``, ``demo``,
  ``batch`` and ``documents`` and what each does once parsed;
- :mod:`specrag.service.run`: a service's start and run: the assets, the options, the engines and
  their pool, the assembly of the stack (used by ``bench/`` too), bind first, the orderly stop;
- :mod:`specrag.service.http`: the HTTP application: one route table, one module per resource,
  and what every request passes through.

Each engine is supervised and its KV events mirrored by the inference side
(:mod:`specrag.pipeline.engines`, :mod:`specrag.pipeline.kv_mirror`); the service pools them.
"""

__all__: list[str] = []
