"""The names of the quantized cache formats and weight formats, importable without torch.

The capability table's pure-PyTorch column lists these (the native columns come from the library,
``csrc/capabilities.h``), and the command line offers them (``kvcache-ext demo --kv-dtype``) without
importing torch for ``--help`` or a wrong name. The formats are specified in ``python_ref/quantize.py``,
whose ``KV_FORMATS`` and ``KIVI_FORMATS`` name the same formats (a test holds them equal).
"""

# Per-token scales: the code formats, then the same with rotated keys.
KV_FORMATS = ("int8", "fp8_e4m3", "int4", "int8_rot", "fp8_e4m3_rot", "int4_rot")
# Per-channel key scales (KIVI): stored by KVCache alone.
KIVI_FORMATS = ("int8_kivi", "fp8_e4m3_kivi", "int4_kivi")
# The weights of a checkpoint's linear layers (kvcache_ext/weight_formats.py): bfloat16, or quantized.
WEIGHT_FORMATS = ("bf16", "int8", "int4")
