"""orderly's faces: the HTTP API (``api.http``) and the command line (``api.cli``)."""
