"""Tensor-parallel plumbing: the group the sharded layers talk through, its shared-memory collectives, and
the localhost channel rank 0 uses to hand each step's inputs to the worker ranks."""
