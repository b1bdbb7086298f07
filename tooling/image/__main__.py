import sys

from tooling.image.check import main

sys.exit(main())
