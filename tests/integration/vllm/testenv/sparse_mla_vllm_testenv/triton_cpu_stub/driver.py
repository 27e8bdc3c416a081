import torch
from triton.backends.driver import DriverBase


class CPUStubDriver(DriverBase):
    """Never active, so Triton never picks it; vLLM only checks that a "cpu" backend exists."""

    @classmethod
    def is_active(cls):
        return False

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("cpu stub driver")

    def get_current_target(self):
        raise NotImplementedError("cpu stub driver: run Triton with TRITON_INTERPRET=1")

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("cpu stub driver")
