"""Tensor-parallel plumbing: the process group the sharded layers talk through, and the localhost
channel rank 0 uses to hand each step's inputs to the worker ranks."""
