"""Adapters to engines users already run (Ray Data, Ray Serve); each needs its optional extra (`pip install -e ".[ray]"`)."""
