"""The device protocol: per-thread CUDAGraph Trees state, the device gate, the eager fence."""
