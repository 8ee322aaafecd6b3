"""GPUs through pynvml (nvidia-ml-py): inventory, busy detection, estimates, monitoring. No torch."""
