"""The web dashboard: a page (static/) and the routes that serve it the run's records, adapters and rollouts."""
