"""Developer tools (demo model builder, example printer, health-check script). Never imported by
the server at run time (an import-linter contract says so)."""
