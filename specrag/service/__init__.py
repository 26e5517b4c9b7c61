"""The running service around the query core, in three rooms by layer; each imports only the rooms
after it in this list (tests/test_dependency_direction.py):

- :mod:`specrag.service.cli`: the command lines of ``specrag prepare``, ``serve``, ``demo``,
  ``batch`` and ``documents`` and what each does once parsed;
- :mod:`specrag.service.run`: a service's start and run: the assets, the options, the engines and
  their pool, the assembly of the stack (used by ``bench/`` too), bind first, the orderly stop;
- :mod:`specrag.service.http`: the HTTP application: one route table, one module per resource,
  and what every request passes through.
"""

__all__: list[str] = []
