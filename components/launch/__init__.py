"""The launcher side: job specs rendered for a cluster and the launchers that run and follow them.

Torch-free: it runs in the components image and the CLI (``tests/test_import_graph.py``).
"""
