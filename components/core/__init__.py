"""The torch-free core that the launcher side and the trainer share.

Config, the fault syntax, events and goodput, the ft_launcher command line and the run directory
layout.
"""
