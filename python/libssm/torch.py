"""libssm.torch: libssm's ops as differentiable torch functions and modules.

Each op family is registered with torch.library (custom ops under the libssm:: namespace, with
fake implementations and autograd), so it runs under torch.compile(fullgraph=True) with no
graph break and inside CUDA graphs, while eager calls take a direct path that skips the
dispatcher. Each family's adapter lives in its own private module; this one re-exports them:
the selective scan (_torch_scan), the causal conv1d (_torch_conv1d) and the fused norms
(_torch_norm). On top of them sit the Mamba mixer (_torch_mamba) and a small Mamba language
model with generation (_torch_mamba_lm)."""

from ._torch_conv1d import causal_conv1d_fn, causal_conv1d_update
from ._torch_norm import LayerNorm, RMSNorm, layer_norm, rms_norm
from ._torch_scan import selective_scan
from ._torch_state_update import selective_state_update
from ._torch_mamba import Mamba
from ._torch_mamba_lm import InferenceParams, MambaConfig, MambaLMHeadModel

__all__ = ["selective_scan", "causal_conv1d_fn", "causal_conv1d_update",
           "selective_state_update",
           "rms_norm", "layer_norm", "RMSNorm", "LayerNorm",
           "Mamba", "MambaConfig", "MambaLMHeadModel", "InferenceParams"]
