from freetoken_agent.cli import main

raise SystemExit(main())
