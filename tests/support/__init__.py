"""Test support: the HTTP doubles (Kubernetes API, KFP API, hostile servers), run helpers,
golden specs and the bad-input cases. Imported as ``support.<module>`` (tests/ is on sys.path:
its conftest.py sits there and tests/ is no package)."""
