"""The tasks' side of parameter-server training: ``Server`` and the ps and worker services it runs."""
