"""Settings checks that need no process (run before torch and Lightning are imported), the error they raise,
and the secrets kept out of every file a run writes. Import each by its module."""
