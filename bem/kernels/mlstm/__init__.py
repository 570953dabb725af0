"""The mLSTM op family (xLSTM's matrix memory, the stabilised "vLSTM" form): CUDA kernels behind one
dispatch point, with a PyTorch reference in three formulations (parallel, chunkwise, recurrent step).

    from bem.kernels.mlstm import mlstm, mlstm_step, zero_state
    h, state = mlstm(q, k, v, igate, fgate, return_last_state=True)     # prefill, any S
    h1, state = mlstm_step(q1, k1, v1, igate1, fgate1, state)            # decode, one token per row

docs/mlstm.md has the shapes, the numerics and how the kernels work.
"""

from .dispatch import mlstm, mlstm_step, mlstm_unavailable_reason
from .reference import mlstm_chunkwise, mlstm_parallel, zero_state

__all__ = ["mlstm", "mlstm_step", "mlstm_unavailable_reason", "mlstm_parallel", "mlstm_chunkwise", "zero_state"]
