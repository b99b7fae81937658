"""Hot-path kernels (oneDNN on CPU today, Triton on CUDA in later work) behind the signatures of the
pure PyTorch functions they accelerate."""
