"""orderly's faces: the HTTP API (``orderly.api.http``) and the command line
(``orderly.api.cli``)."""
