"""The paged engine. Importing it sets OpenMP's wait policy before torch loads (engine/threads.py)."""

from engine.threads import apply_openmp_defaults

apply_openmp_defaults()
