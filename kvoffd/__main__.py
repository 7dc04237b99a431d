from kvoffd.cli import main

raise SystemExit(main())
