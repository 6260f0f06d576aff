"""gpupack's kubelet device plugin: NVML discovery, kubelet registration, health and the Allocate handoff."""
