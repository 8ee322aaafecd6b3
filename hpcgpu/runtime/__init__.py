"""Inside the job: environment detection, process group, strategies, checkpoints, tasks."""
