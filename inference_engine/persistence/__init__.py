"""Sessions on disk: the state directory (plain Python, `state_dir.py`), model identity, and the
engine-side SessionPersister that writes and reads a session's segments (`session_files.py`)."""
