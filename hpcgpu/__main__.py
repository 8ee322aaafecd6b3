import sys

if len(sys.argv) > 1 and sys.argv[1] == "run":
    from hpcgpu.procs import die_with_parent

    die_with_parent()  # a rank of the local executor dies with it (HPCGPU_PARENT_PID; no-op otherwise)
    # the in-job entrypoint: remember a preemption signal that comes before the task is ready
    from hpcgpu.runtime.signals import catch_early_signals

    catch_early_signals()
    from hpcgpu.image import check_image

    check_image()  # in a container: an image without hpcgpu's dependencies is one line, not a traceback

from hpcgpu.cli import main  # noqa: E402

main()
