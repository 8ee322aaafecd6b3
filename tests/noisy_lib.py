"""A user's library that warns at every call (tests/unit/test_quiet.py, tests/slurm/test_quiet_slurm.py)."""
import warnings


def noisy_call():
    with warnings.catch_warnings():  # as many libraries do per call: Python forgets it showed the warning
        pass
    warnings.warn("noisy_call is deprecated", FutureWarning)


def main(ctx):
    noisy_call()
    noisy_call()
    return 0
