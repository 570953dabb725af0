"""Sequence-mixer blocks bolted onto a wrapped model's residual stream: Hyena (FFT long convolution) and mLSTM
(matrix memory). See `block.py` for how they attach, `hyena.py` and `mlstm.py` for the mixers."""

from .block import MIXERS, MixerBlock, attach, resolve_layers, state_name
from .hyena import HyenaMixer
from .mlstm import MLSTMMixer
from .state import MixerState

__all__ = ["MIXERS", "HyenaMixer", "MLSTMMixer", "MixerBlock", "MixerState", "attach", "resolve_layers",
           "state_name"]
