"""``python -m orderly.api.cli``: the same as the ``orderly`` script."""

from orderly.api.cli import main

main()
