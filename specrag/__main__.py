from specrag.cli import main

raise SystemExit(main())
