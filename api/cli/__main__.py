"""``python -m api.cli``: the same as the ``orderly`` script."""

from api.cli import main

main()
