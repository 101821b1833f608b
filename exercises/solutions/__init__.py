"""Reference solutions of the exercises, for teachers: same names and signatures as the
student files, with the stubs filled in. Not part of a student handout
(`python -m exercises.handout DIR` leaves this package out).

    python -m exercises.check 01 --solution     # the checker passes on these
"""
