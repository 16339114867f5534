"""TF's own tests, ported: one file per TF source file (see each file's docstring)."""

# worker scripts run as their own processes; never import them as test modules
collect_ignore = ["scripts"]
