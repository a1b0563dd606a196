"""libssm.torch: libssm's ops as differentiable torch functions and modules.

Each op family is registered with torch.library (custom ops under the libssm:: namespace, with
fake implementations and autograd), so it runs under torch.compile(fullgraph=True) with no
graph break and inside CUDA graphs, while eager calls take a direct path that skips the
dispatcher. Each family's adapter lives in its own private module; this one re-exports them:
the selective scan (_torch_scan) and the fused norms (_torch_norm)."""

from ._torch_norm import LayerNorm, RMSNorm, layer_norm, rms_norm
from ._torch_scan import selective_scan

__all__ = ["selective_scan", "rms_norm", "layer_norm", "RMSNorm", "LayerNorm"]
