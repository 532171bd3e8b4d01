from twinpipe.cli import main

raise SystemExit(main())
