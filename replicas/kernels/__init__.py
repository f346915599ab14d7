"""GPU kernels of the replica (Triton). Each has a plain-torch reference in replicas/."""
