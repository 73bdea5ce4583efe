"""Adapters to engines users already run (Ray Data); each needs its optional extra (`pip install -e ".[ray]"`)."""
