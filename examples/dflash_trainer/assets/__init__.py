"""The trainer's inputs when none are given: the embedded default assets (``assets`` caches them,
``assets_build`` builds them), random-init targets of published shapes (``shapes``), and the
checks that a run and a build fit in the memory and disk there are (``sizes``, ``capacity``)."""
