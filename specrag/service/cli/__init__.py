"""The service's commands: ``parser`` holds the command lines of ``specrag prepare``, ``serve``,
``demo`` and ``batch`` (registered by :mod:`specrag.cli`), ``commands`` what each does once parsed;
``document_commands`` is ``specrag documents``, both halves; ``demo`` and ``engine_log`` serve the
commands. A new command: its parser in ``parser.register``, its function in ``commands``."""

__all__: list[str] = []
