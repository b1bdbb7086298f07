"""``python -m tooling.sink``: the sink in the foreground."""

import sys

from tooling.sink.client import main

sys.exit(main())
