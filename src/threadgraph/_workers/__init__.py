"""Worker threads, groups, step statistics and whole-step capture."""
