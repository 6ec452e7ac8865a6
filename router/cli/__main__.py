from router.cli import main

raise SystemExit(main())
