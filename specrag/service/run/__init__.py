"""A service's start and run, below the command line and above the HTTP application: the assets it
serves (``assets``), what shapes it (``options``), its engines and their pool (``pools``,
``pinning``), the stack assembled (``assembly``, which ``bench/`` uses too), the start that binds
first (``startup``, whose small application answers 503 while the service starts), the run until a
signal (``lifecycle``) and the warning when it is exposed (``exposure``). Never imports
:mod:`specrag.service.cli`."""

__all__: list[str] = []
