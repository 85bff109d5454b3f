"""Weight quantization: one scheme class per format behind one linear-layer interface.

- base.py: `LinearScheme`, the interface the model's matmul hook calls (`scheme_of(layer)`), and
  the unquantized scheme;
- fp8.py: FP8 W8A8 (float8 e4m3 weights with a scale per output row, activations per token);
- checkpoint.py: a checkpoint's `quantization_config` read (compressed-tensors FP8) or refused;
- plan.py: which scheme an engine's model gets (the `quantization` option and the checkpoint),
  set on its linear layers around loading.

Kept free of imports here, so that reading a config does not import torch.
"""
