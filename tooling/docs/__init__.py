"""The documentation site's generated pages: reference built from the code at build time."""
