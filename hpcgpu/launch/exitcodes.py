"""Exit codes shared by the job and the launchers (kept here so host code needs no runtime import)."""
EXIT_FINISHED = 0
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped at a checkpoint after a preemption/timeout signal or Ctrl-C
