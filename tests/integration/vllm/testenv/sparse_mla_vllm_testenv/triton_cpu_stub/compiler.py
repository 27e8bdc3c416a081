from triton.backends.compiler import BaseBackend


class CPUStubBackend(BaseBackend):
    """Refuses every target: only TRITON_INTERPRET=1 runs kernels in the test venv."""

    @staticmethod
    def supports_target(target):
        return False

    def hash(self):
        return "sparse-mla-cpu-stub"

    def parse_options(self, options):
        raise NotImplementedError("cpu stub backend: run Triton with TRITON_INTERPRET=1")

    def add_stages(self, stages, options, language):
        raise NotImplementedError("cpu stub backend: run Triton with TRITON_INTERPRET=1")

    def load_dialects(self, context):
        pass

    def get_module_map(self):
        return {}
