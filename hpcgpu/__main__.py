from hpcgpu.cli import main

main()
