"""Host side: sbatch rendering, executors, registry, scheduler queries. Never imports torch or runtime/."""
