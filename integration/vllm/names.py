"""The attention-backend names the plugin adds, and the sparse_mla backend each one runs."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class BackendName:
    name: str               # what users pass to --attention-backend
    backend: str            # the sparse_mla backend package (backends/<backend>)
    fp8_ds_mla_layout: bool  # caches in FlashMLA's 584 B layout (else plain rows)


SPARSE_MLA = BackendName("SPARSE_MLA", "flashmla", True)
SPARSE_MLA_TRTLLM = BackendName("SPARSE_MLA_TRTLLM", "trtllm", False)
ALL = {b.name: b for b in (SPARSE_MLA, SPARSE_MLA_TRTLLM)}

# DeepSeek-V3.2's name (integration/vllm/v32.py). Not in ALL: ALL names the V4 layer classes
# the plugin patches in; V3.2 needs no patch (its layer asks vLLM's registry).
V32 = "SPARSE_MLA_V32"
# GLM-5.3's (glm5next; integration/vllm/glm5.py), through the registry as V3.2's.
GLM5 = "SPARSE_MLA_GLM5"


def lookup(selected):
    """The BackendName for vLLM's configured attention backend (an enum member, a string or
    None), or None when it is not one of ours."""
    if selected is None:
        return None
    name = getattr(selected, "name", selected)
    return ALL.get(name) if isinstance(name, str) else None


def backend_class(which: BackendName):
    if which.backend == "flashmla":
        from sparse_mla.backends.v4 import FlashMLABackend
        return FlashMLABackend
    from sparse_mla.backends.v4 import TrtllmBackend
    return TrtllmBackend
