"""A Triton backend named "cpu" that compiles nothing: with TRITON_INTERPRET=1 every kernel
runs in Triton's interpreter, so the backend is never asked to compile or launch."""
