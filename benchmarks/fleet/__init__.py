"""The fleet model (``python -m benchmarks.fleet_model``), by concern: ``sim`` and ``resources`` (the
discrete-event mechanism), ``model`` (costs to a prediction), ``calibrate`` (the 2-core setting against its
measured runs), ``project`` (the fleets), ``render`` (tables and figures), ``measure`` (costs read from
finished runs), ``probe`` (costs measured on this machine) and ``record`` (what goes into the costs file)."""
