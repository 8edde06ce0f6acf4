"""doctor, its GPU self-test, and the hazard table."""
