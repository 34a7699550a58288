"""The web dashboard: adapters, curves, the loop's stages and rollouts (`/ui`; `python -m miles.dashboard RUN_DIR`)."""
