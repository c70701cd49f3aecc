"""`python -m kvtui.cli`: the kvtui command line."""

import sys

from kvtui.cli.app import main

sys.exit(main())
