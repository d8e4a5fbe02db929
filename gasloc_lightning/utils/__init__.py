"""Small helpers every layer may use, below all of them: a long script's progress, the ``H:MM:SS`` form of a
duration, a JSON record written atomically. Pure Python: no torch, no Lightning, no import of the package."""
