"""Planning the E:P:D split: stage costs from a profile (``costs``), a discrete-event simulator of
the router and tiers (``engine``, ``tiers``, ``simulate``), and ``epd plan`` (``planner``)."""
