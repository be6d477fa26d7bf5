"""The torch side: the FSDP trainer, its checkpoints, the model and the export of a run.

Runs in the trainer image; nothing on the launcher side imports it (``tests/unit/test_import_graph.py``).
"""
