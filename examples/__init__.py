"""Examples of your own code run by hpcgpu (`task: callable`, `entry: examples.<module>:main`)."""
