"""The coordinator's side of parameter-server training: scheduling, dispatch, remote values, failure policy."""
