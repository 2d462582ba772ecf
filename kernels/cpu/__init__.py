"""The CPU backend: C kernels built at first use (native.py, csrc/ one source per op), their checking
launchers (paged_attention, store_kv, linear, onednn_linear, elementwise) and the bound op set (ops.py)."""
