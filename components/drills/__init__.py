"""Fault drills: the local backend run through a matrix of faults (``kfp-nvrx drill``)."""
