"""Build orderly's container image on a local Debian base and run it (``./run.sh image``)."""
