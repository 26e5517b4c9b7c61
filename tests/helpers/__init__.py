"""What the tests share besides fixtures, one module per job: ``waiting`` (poll until something
holds), ``engines`` (drive an engine; simulated and stand-in engines), ``tree`` (the knowledge-tree
tests' tiny engine), ``builders`` (controllers and their parts), ``flights`` (answers under
RetriedFlight on simulated replicas), ``http`` (services the tests start and what they answer),
``models`` (model files and stores), ``live_corpus`` (live corpora and their stand-ins),
``kv_events`` (a KV-event publisher and the engine's cache reset), ``network`` (no network in a
test), ``vectors`` (synthetic vectors' sizes and passages).

Fixtures live in the ``conftest.py`` files; everything else more than one test module needs lives
here, once. No test module imports another test module (or a conftest), so a test file can change
or go without breaking the others (tests/test_test_layout.py checks it).
"""
