from jaxgpt.cli import main

raise SystemExit(main())
