"""Pool node server."""
