"""minipar's classroom exercises: rebuild a piece of distributed training yourself and let
a checker hold it against the real thing.

    python -m exercises.check            # list the exercises
    python -m exercises.check 01         # check your exercises/ex01_ring_allreduce.py

Student files are exercises/exNN_*.py; the checkers live in exercises/checkers/ and the
reference solutions, for teachers, in exercises/solutions/. See exercises/README.md.
"""
