from specdraft.cli import main

raise SystemExit(main())
